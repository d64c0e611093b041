"""The one base of the stored-KV formats: every format of the registry stores the bytes, and reads back the values,
that its own class did before the formats shared :class:`~ced_csa2.kv.block_format.BlockFormat`.

The digests below were taken from those classes (``kv/fp4.py``'s ``NVFP4``/``MXFP4`` and ``kv/fp6.py``'s
``FP6``/``MXFP6``, each with its own quantise and dequantise) on :func:`seeded`: a refactor of the base that moves
one stored bit or one read-back value fails here, whichever format it touches.  A new format pins its own row.
"""

import hashlib

import pytest
import torch

from ced_csa2.kv.formats import FORMATS, FP4_FORMATS, StreamFormat
from ced_csa2.kv.rotation import fp4_round_trip, layer_rotation

# (format, group) -> sha256[:16] of: element bytes, scale bytes, dequantize() in float32, in bf16, and
# dequantize(quantize(x in bf16)) in bf16.
BLOCK_DIGESTS = {
    ('fp6', 16): ('faf87da68c4c89c8', '3df94d7a6f81333b', 'd03137e70651512f', '5cbc4b87b9ffa539', '2065c8aaa95df371'),
    ('fp6', 32): ('74fef26eab58f04a', '2ae23f4c091c47c5', '935f84ec11a0124a', 'bed9b5dbd575cf54', '14f6ae07b3f1ce6b'),
    ('mxfp4', 16): ('c736ace4aa69fa3e', 'e5e5669ccf1b29a8', '7109138de23925d9', '36a074cfce66d958', '81815e3d3ad83ae2'),
    ('mxfp4', 32): ('294f8e11e041c447', '538ec8cd19cf8c02', 'a531d6b22e969fcd', 'd91cef565e8bf1d2', 'd96e12d72385e9c9'),
    ('mxfp6', 16): ('af824c99792b6b49', 'e5e5669ccf1b29a8', '19095ea6df6507ef', 'ac00f9bfc7a9bc76', 'ca9db9da675eff5d'),
    ('mxfp6', 32): ('b1a149ca3da1d343', '538ec8cd19cf8c02', '9861e336e6912dac', '02598c64cd3ba203', 'f89a40546660307c'),
    ('nvfp4', 16): ('411a4f9991eebd0b', '5a62b73b31a21c05', '801036bbb124f20d', '0fef9918a860afd2', '946cb54f7c581a85'),
    ('nvfp4', 32): ('7afa741ceb8c8973', '27bdd449573ab270', 'ec8cfb249de05d66', '19f7f29065db69d2', '4f1db6dd1c293be5'),
}
# (format, axis) -> the bf16 round trip of StreamFormat(format, 16, axis, rotate=True) with layer 3's rotation.
STREAM_DIGESTS = {
    ('fp6', 'channels'): 'e6da02fc3bed11f6',
    ('fp6', 'tokens'): '7133381d99ce94b5',
    ('mxfp4', 'channels'): 'd7dd3cb5d157a021',
    ('mxfp4', 'tokens'): '16971fa41096f3b6',
    ('mxfp6', 'channels'): 'b12f9ae770db8735',
    ('mxfp6', 'tokens'): 'dc40af71631e0633',
    ('nvfp4', 'channels'): '57903fae4b6b27cb',
    ('nvfp4', 'tokens'): '0ae2d91bf974a036',
}
# FP4 format -> round_trip(x in bf16), fp4_round_trip(fmt, x in bf16, rotation), round_trip(x, float32):
# what Mode B's *_fp4 and *_fp4_rot groups read.
FP4_ROUND_TRIP_DIGESTS = {
    'mxfp4': ('d96e12d72385e9c9', 'e2dfc34a174ebd39', 'a531d6b22e969fcd'),
    'nvfp4': ('946cb54f7c581a85', '57903fae4b6b27cb', '801036bbb124f20d'),
}


def seeded() -> torch.Tensor:
    """``(2, 6, 128)`` float32: Gaussian entries with an outlier channel, an all-zero entry, blocks whose E4M3
    scale is subnormal and a block past E4M3's range (saturating)."""
    g = torch.Generator().manual_seed(65)
    x = torch.randn(2, 6, 128, generator=g)
    x[..., 3] *= 40.0
    x[0, 1] = 0.0
    x[1, 2] *= 1e-4
    x[1, 3, :16] *= 5e3
    return x


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def test_every_pinned_format_is_registered():
    assert {name for name, _ in BLOCK_DIGESTS} <= set(FORMATS)
    assert {name for name, _ in STREAM_DIGESTS} <= set(FORMATS) and set(FP4_ROUND_TRIP_DIGESTS) <= set(FP4_FORMATS)


@pytest.mark.parametrize("name, group", sorted(BLOCK_DIGESTS))
def test_a_format_stores_and_reads_back_what_its_own_class_did(name, group):
    x, fmt = seeded(), FORMATS[name](group)
    packed = fmt.quantize(x)
    bf16 = x.to(torch.bfloat16)
    got = (digest(packed.elements), digest(packed.scales), digest(fmt.dequantize(packed)),
           digest(fmt.dequantize(packed, torch.bfloat16)), digest(fmt.dequantize(fmt.quantize(bf16), torch.bfloat16)))
    assert got == BLOCK_DIGESTS[name, group]


@pytest.mark.parametrize("name, axis", sorted(STREAM_DIGESTS))
def test_a_rotated_stream_reads_back_what_it_did(name, axis):
    got = StreamFormat(name, 16, axis, rotate=True).round_trip(seeded().to(torch.bfloat16), layer_rotation(64, 3))
    assert digest(got) == STREAM_DIGESTS[name, axis]


@pytest.mark.parametrize("name", sorted(FP4_ROUND_TRIP_DIGESTS))
def test_the_fp4_groups_read_back_what_they_did(name):
    x, fmt = seeded(), FP4_FORMATS[name]()
    bf16 = x.to(torch.bfloat16)
    got = (digest(fmt.round_trip(bf16)), digest(fp4_round_trip(fmt, bf16, layer_rotation(64, 3))),
           digest(fmt.round_trip(x, torch.float32)))
    assert got == FP4_ROUND_TRIP_DIGESTS[name]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_format_s_round_trip_is_dequantize_of_quantize_and_its_bytes_are_entry_bytes(name):
    fmt = FORMATS[name]()
    x = seeded()
    for y in (x, x.to(torch.bfloat16), x.transpose(0, 1)):
        want = fmt.dequantize(fmt.quantize(y), y.dtype)
        got = fmt.round_trip(y)
        assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    packed = fmt.quantize(x)
    per_entry = 128 * fmt.element.bits // 8 + 128 // fmt.group
    assert packed.nbytes == packed.entries * fmt.entry_bytes(128) == 12 * per_entry

