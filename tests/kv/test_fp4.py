"""FP4 storage formats (docs/design.md §7, seed 003 §4.4): E2M1 codes, NVFP4-style and OCP MXFP4 blocks."""

import math

import pytest
import torch

from ced_csa2.kv import block_format
from ced_csa2.kv.block_format import Packed
from ced_csa2.kv.fp4 import (
    E2M1,
    MXFP4,
    NVFP4,
    e2m1_decode,
    e2m1_encode,
    e4m3_scale_bytes,
    e8m0_scale_bytes,
    e8m0_scale_values,
    pack_nibbles,
    unpack_nibbles,
)
from ced_csa2.kv.kv_bytes import fp4_entry_bytes

MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def down(v):
    return torch.nextafter(torch.tensor(v, dtype=torch.float32), torch.tensor(-math.inf)).item()


def up(v):
    return torch.nextafter(torch.tensor(v, dtype=torch.float32), torch.tensor(math.inf)).item()


def reference_codes(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes from the definition: the nearest magnitude, ties to the even code, sign bit kept."""
    a = x.double().abs().unsqueeze(-1)
    dist = (a - torch.tensor(MAGNITUDES, dtype=torch.float64)).abs()
    best = dist.min(dim=-1, keepdim=True).values
    tied = dist == best                                     # one or two candidates
    even = tied & (torch.arange(8) % 2 == 0)
    mag = torch.where(even.any(-1), even.int().argmax(-1), tied.int().argmax(-1))
    return (mag | (torch.signbit(x).long() << 3)).to(torch.uint8)


def half_spacing(r: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 code spacing at scaled magnitude ``r``: 0.25 on [0, 2], 0.5 on (2, 4], 1 on (4, 6]."""
    return torch.where(r <= 2, 0.25, torch.where(r <= 4, 0.5, 1.0)).double()


def block_scales(fmt, packed):
    return fmt.scale.to_values(packed.scales).double()


# ----------------------------------------------------------------------------- E2M1 codes

def test_every_code_round_trips_and_zero_keeps_its_sign():
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_decode(codes)
    assert values.tolist() == MAGNITUDES + [-m for m in MAGNITUDES]
    assert torch.equal(e2m1_encode(values), codes)
    # ±0: codes 0 and 8 both decode to zero, told apart by the sign bit, and encode back apart
    assert values[0] == values[8] == 0 and not torch.signbit(values[0]) and torch.signbit(values[8])
    assert e2m1_encode(torch.tensor([0.0, -0.0, -0.1])).tolist() == [0, 8, 8]


# midpoint -> the even neighbour's code (even = mantissa bit 0)
MIDPOINTS = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}


@pytest.mark.parametrize("mid, code", MIDPOINTS.items())
def test_midpoints_round_to_even_and_neighbours_to_nearest(mid, code):
    lo = max(i for i, m in enumerate(MAGNITUDES) if m < mid)
    x = torch.tensor([mid, down(mid), up(mid)])
    assert e2m1_encode(x).tolist() == [code, lo, lo + 1]
    assert e2m1_encode(-x).tolist() == [code | 8, lo | 8, (lo + 1) | 8]


def test_saturates_to_six():
    big = torch.tensor([6.0, up(6.0), 6.5, 7.0, 8.0, 1e6, 3e38, math.inf])
    assert e2m1_encode(big).tolist() == [7] * 8
    assert e2m1_encode(-big).tolist() == [15] * 8


def test_encode_matches_the_definition_on_a_float32_sweep():
    g = torch.Generator().manual_seed(0)
    # every 257th float32 bit pattern from +0 up to 8.0 (~4.3M values), plus random signs
    sweep = torch.arange(0, 0x41000001, 257, dtype=torch.int64).to(torch.int32).view(torch.float32)
    sign = torch.where(torch.rand(sweep.shape, generator=g) < 0.5, -1.0, 1.0)
    x = torch.cat([sweep * sign, torch.randn(100_000, generator=g) * 4])
    assert torch.equal(e2m1_encode(x), reference_codes(x))


def test_encode_accepts_other_dtypes_and_rejects_nan():
    x = torch.tensor([0.74, 1.3, -5.1, 0.2])
    assert torch.equal(e2m1_encode(x.to(torch.bfloat16)), reference_codes(x.to(torch.bfloat16)))
    assert torch.equal(e2m1_encode(x.double()), e2m1_encode(x))
    with pytest.raises(ValueError, match="NaN"):
        e2m1_encode(torch.tensor([1.0, math.nan]))


def test_pack_puts_the_even_element_in_the_low_nibble_and_round_trips():
    assert pack_nibbles(torch.tensor([0x1, 0x2, 0xF, 0x0], dtype=torch.uint8)).tolist() == [0x21, 0x0F]
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed), codes)
    every_byte = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_nibbles(unpack_nibbles(every_byte)), every_byte)
    with pytest.raises(ValueError, match="D = 3"):
        pack_nibbles(torch.zeros(3, dtype=torch.uint8))


# ----------------------------------------------------------------------------- hand-computed blocks

def test_nvfp4_hand_block_exact_scale():
    # amax 3 -> scale 3/6 = 0.5 exactly (E4M3 0 0110 000 = 0x30); x / 0.5 hits codes and midpoints
    t = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -6]
    # codes 0 1 2 3 4 5 6 7 | 8 (-0.25 -> -0) A A C C E E F
    p = NVFP4().quantize(torch.tensor(t) * 0.5)
    assert p.scales.tolist() == [0x30]
    assert bytes(p.elements.tolist()).hex() == "10325476a8caecfe"


def test_nvfp4_hand_block_rounded_scale_and_saturation():
    # amax 2.9: 2.9/6 = 0.4833 lies between E4M3 0.46875 (0x2F) and 0.5 (0x30), below their
    # midpoint 0.484375 -> s = 0.46875 = 15/32; 2.9 / s = 6.19 saturates to 6 (code 7)
    s = 15 / 32
    t = [-6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 5.5, -0.5, -1, -2, -3, -4, 0]
    # codes: 7 | F 0 2 2 4 4 6 6 7 9 A C D E 0
    x = torch.tensor([2.9] + [v * s for v in t])
    p = NVFP4().quantize(x)
    assert p.scales.tolist() == [0x2F]
    assert bytes(p.elements.tolist()).hex() == "f720426476a9dc0e"
    assert NVFP4().dequantize(p)[0].item() == 6 * s


def test_mxfp4_hand_block():
    # amax 7.75/16 = 0.484375: floor(log2) = -2 -> s = 2^-4, byte 127 - 4 = 0x7B; x / s = t
    t = [7.75, -7.0, 6.5, 6.0, 5.0, 4.9, -4.5, 3.5, 3.25, 2.5, 2.25, 1.75, 1.25, 0.75, 0.25, 0.125,
         -0.125, -0.25, -0.5, -0.75, -1.0, -1.25, -1.5, -1.75, -2.0, -2.5, -3.0, -3.5, -4.0, -5.0, -6.0, 0.0]
    codes = [7, 15, 7, 7, 6, 6, 14, 6, 5, 4, 4, 4, 2, 2, 0, 0,
             8, 8, 9, 10, 10, 10, 11, 12, 12, 12, 13, 14, 14, 14, 15, 0]
    fmt = MXFP4()
    p = fmt.quantize(torch.tensor(t) / 16)
    assert p.scales.tolist() == [0x7B]
    assert unpack_nibbles(p.elements).tolist() == codes
    assert bytes(p.elements.tolist()).hex() == "f777666e4544220088a9aacbccedee0f"
    assert fmt.dequantize(p).tolist() == [e2m1_decode(torch.tensor(c)).item() / 16 for c in codes]


# ----------------------------------------------------------------------------- scales

def e4m3_positive_values():
    return torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 2^-9 .. 448


def test_nvfp4_scales_are_amax_over_6_cast_to_e4m3():
    v = e4m3_positive_values()
    mids = (v[:-1] + v[1:]) / 2
    targets = torch.cat([v, mids, torch.nextafter(mids, torch.zeros(())), torch.nextafter(mids, torch.full((), 1e9)),
                         torch.exp2(torch.empty(2000).uniform_(-9, 8.8, generator=torch.Generator().manual_seed(2)))])
    amax = targets * 6
    # a block per amax: the maximum in a random channel with a random sign, the rest smaller
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(len(amax), 16, generator=g) * 2 - 1) * amax[:, None] * 0.99
    col = torch.randint(0, 16, (len(amax),), generator=g)
    x[torch.arange(len(amax)), col] = amax * torch.where(torch.rand(len(amax), generator=g) < 0.5, -1.0, 1.0)
    got = NVFP4().quantize(x).scales[:, 0]
    want = torch.tensor([a / 6 for a in x.abs().amax(-1).tolist()]).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(got, want)
    assert torch.equal(e4m3_scale_bytes(amax), want)


def test_nvfp4_scale_edge_rules():
    fmt = NVFP4()
    tiny = 6 * 2.0 ** -10  # amax/6 = 2^-10: the E4M3 tie between 0 and 2^-9 rounds to 0 -> clamped to 0x01
    x = torch.stack([torch.zeros(16), torch.full((16,), -0.0), torch.full((16,), tiny), torch.full((16,), 1e-30),
                     torch.full((16,), 6 * 500.0), torch.linspace(-1e5, 1e5, 16)])
    p = fmt.quantize(x)
    assert p.scales[:, 0].tolist() == [0x00, 0x00, 0x01, 0x01, 0x7E, 0x7E]
    y = fmt.dequantize(p)
    assert y[:2].abs().max() == 0 and torch.signbit(y[1]).all()   # zero blocks decode to (signed) zero
    assert torch.equal(y[2], torch.full((16,), tiny))              # tiny / 2^-9 = 3: code 5, exact
    assert y[3].abs().max() == 0                                   # 1e-30 / 2^-9 rounds to zero
    assert y[4:].abs().max() == 6 * 448 == 2688                    # overflow clips at 6 · 448


def test_mxfp4_scales_are_exact_powers_of_two_with_the_stated_exponent():
    g = torch.Generator().manual_seed(4)
    amax = torch.cat([torch.exp2(torch.empty(3000).uniform_(-124, 127.9, generator=g)),
                      torch.exp2(torch.arange(-124, 128, dtype=torch.float32)),           # exact powers
                      torch.tensor([1.0, 3.999, 4.0, 6.0, 7.99, 8.0, 0.3])])
    got = e8m0_scale_bytes(amax)
    want = torch.tensor([math.frexp(a)[1] - 1 - 2 + 127 for a in amax.tolist()], dtype=torch.uint8)
    assert torch.equal(got, want)
    scale = e8m0_scale_values(got)
    assert torch.equal(scale.double(), torch.tensor([2.0 ** (b - 127) for b in got.tolist()], dtype=torch.float64))
    r = amax / scale
    assert (r >= 4).all() and (r < 8).all()  # the block max lands in E2M1's top [4, 8) before saturation
    # all 255 finite bytes decode to their power of two; 0xFF (NaN) is refused
    every = torch.arange(255, dtype=torch.uint8)
    assert e8m0_scale_values(every).double().tolist() == [2.0 ** (b - 127) for b in range(255)]
    with pytest.raises(ValueError, match="0xFF"):
        e8m0_scale_values(torch.tensor([255], dtype=torch.uint8))


def test_mxfp4_scale_edge_rules():
    x = torch.stack([torch.zeros(32), torch.full((32,), 2.0 ** -126), torch.full((32,), 2.0 ** -130),
                     torch.full((32,), 3e38)])
    p = MXFP4().quantize(x)
    # zero block and exponents below -127 -> byte 0 (2^-127); floor(log2 3e38) = 127 -> 127 - 2 + 127
    assert p.scales[:, 0].tolist() == [0, 0, 0, 252]
    y = MXFP4().dequantize(p)
    assert y[0].abs().max() == 0
    assert torch.equal(y[1], x[1])                  # 2^-126 / 2^-127 = 2: exact
    assert y[2].abs().max() == 0                    # 2^-130 / 2^-127 = 1/8 rounds to zero
    assert torch.equal(y[3], torch.full((32,), 6 * 2.0 ** 125))  # 3e38 / 2^125 = 7.05 saturates to 6


# ----------------------------------------------------------------------------- quantisation error

def gaussian_blocks(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    # one magnitude per row over 2^-3 .. 2^6, so scales span many binades but stay E4M3-normal
    return torch.randn(n, d, generator=g) * torch.exp2(torch.empty(n, 1).uniform_(-3, 6, generator=g))


@pytest.mark.parametrize("fmt", [NVFP4(), MXFP4()], ids=["nvfp4", "mxfp4"])
def test_elements_are_e2m1_of_x_over_scale(fmt):
    x = gaussian_blocks(64, 128, seed=5)
    p = fmt.quantize(x)
    s = fmt.scale.to_values(p.scales).repeat_interleave(fmt.group, dim=-1)
    assert torch.equal(unpack_nibbles(p.elements), e2m1_encode(x / s))


def test_nvfp4_error_within_half_a_code_spacing():
    fmt = NVFP4()
    x = gaussian_blocks(512, 256, seed=6)
    p = fmt.quantize(x)
    s = block_scales(fmt, p).repeat_interleave(16, dim=-1)
    assert (s >= 2.0 ** -6).all()  # the bound below is for normal E4M3 scales
    r = x.double().abs() / s
    # E4M3 rounds amax/6 to within 2^-4 relative, so the block max sits at most at 6 / (1 - 2^-4) = 6.4
    assert r.max() <= 6.4
    err = (fmt.dequantize(p).double() - x.double()).abs()
    # half a code spacing at the scaled magnitude; past 6, saturation costs <= 0.4 s, inside the top bin's 1 s
    assert (err <= half_spacing(r.clamp(max=6)) * s).all()
    assert (err <= s).all()
    grid = torch.tensor(MAGNITUDES, dtype=torch.float64)
    nearest = (r.unsqueeze(-1) - grid).abs().min(-1).values * s  # best any code could do with this scale
    assert (err <= nearest + 1e-6 * s).all()


def test_mxfp4_error_within_half_a_code_spacing_or_the_saturated_band():
    fmt = MXFP4()
    x = gaussian_blocks(512, 256, seed=7)
    p = fmt.quantize(x)
    s = block_scales(fmt, p).repeat_interleave(32, dim=-1)
    r = x.double().abs() / s
    assert r.max() < 8
    err = (fmt.dequantize(p).double() - x.double()).abs()
    inside = r <= 6
    assert (err[inside] <= (half_spacing(r) * s)[inside]).all()
    # (6, 8): saturated to 6, error |x| - 6 s < 2 s
    assert torch.allclose(err[~inside], (x.double().abs() - 6 * s)[~inside], rtol=0, atol=1e-12)
    assert (err < 2 * s).all()
    assert (~inside).any()  # Gaussian blocks do reach the band


# ----------------------------------------------------------------------------- packed layout, bytes, API

@pytest.mark.parametrize("fmt, d, per_entry", [(NVFP4(), 512, 288), (MXFP4(), 128, 68),
                                              (NVFP4(), 1024, 576), (MXFP4(), 1024, 544)])
def test_nbytes_equal_fp4_entry_bytes(fmt, d, per_entry):
    x = torch.randn(2, 3, d)
    p = fmt.quantize(x)
    assert p.elements.shape == (2, 3, d // 2) and p.scales.shape == (2, 3, d // fmt.group)
    assert p.elements.dtype == p.scales.dtype == torch.uint8
    assert p.nbytes == p.elements.nbytes + p.scales.nbytes == 6 * fp4_entry_bytes(d, fmt.group) == 6 * per_entry
    assert fmt.entry_bytes(d) == per_entry and p.entries == 6


@pytest.mark.parametrize("fmt", [NVFP4(), MXFP4()], ids=["nvfp4", "mxfp4"])
def test_round_trip_shapes_dtypes_and_chunking(fmt, monkeypatch):
    x = gaussian_blocks(40, 64, seed=8).view(5, 8, 64)
    p = fmt.quantize(x)
    y = fmt.dequantize(p)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert torch.equal(fmt.dequantize(p, torch.bfloat16), y.to(torch.bfloat16))
    # a decoded tensor is already on the grid: re-quantising it reproduces the same bytes
    again = fmt.quantize(y)
    assert torch.equal(again.elements, p.elements) and torch.equal(again.scales, p.scales)
    # bf16 and non-contiguous inputs
    xb = x.to(torch.bfloat16)
    assert torch.equal(fmt.quantize(xb).elements, fmt.quantize(xb.float()).elements)
    xt = x.transpose(0, 1)
    assert torch.equal(fmt.dequantize(fmt.quantize(xt)), y.transpose(0, 1))
    # chunking over rows does not change the result
    monkeypatch.setattr(block_format, "CHUNK_ELEMS", 3 * 64)
    small = fmt.quantize(x)
    assert torch.equal(small.elements, p.elements) and torch.equal(small.scales, p.scales)
    assert torch.equal(fmt.dequantize(small), y)


def test_shape_and_value_errors():
    with pytest.raises(ValueError, match=r"D = 24, G = 16"):
        NVFP4().quantize(torch.randn(2, 24))
    with pytest.raises(ValueError, match=r"D = 48, G = 32"):
        MXFP4().quantize(torch.randn(48))
    with pytest.raises(ValueError, match=r"D = 3, G = 1"):
        NVFP4(group=1).quantize(torch.randn(3))
    for bad in (math.nan, math.inf, -math.inf):
        x = torch.randn(4, 32)
        x[2, 5] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            NVFP4().quantize(x)
        with pytest.raises(ValueError, match="NaN or Inf"):
            MXFP4().quantize(x)
    with pytest.raises(ValueError, match="cannot decode"):
        MXFP4().dequantize(NVFP4().quantize(torch.randn(2, 32)))
    with pytest.raises(ValueError, match="scales must be"):
        Packed(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8), torch.Size([2, 32]),
               NVFP4())


def test_formats_hold_group_and_scale_kind():
    assert (NVFP4().group, NVFP4().scale_kind) == (16, "e4m3")
    assert (MXFP4().group, MXFP4().scale_kind) == (32, "e8m0")
    assert NVFP4(group=32).entry_bytes(512) == fp4_entry_bytes(512, 32)


def test_e2m1_round_is_the_decoded_code_on_a_float32_sweep():
    # the values-only rounding of round_trip: e2m1_decode(codes) bit for bit, -0.0 included
    g = torch.Generator().manual_seed(1)
    sweep = torch.arange(0, 0x41000001, 257, dtype=torch.int64).to(torch.int32).view(torch.float32)
    sign = torch.where(torch.rand(sweep.shape, generator=g) < 0.5, -1.0, 1.0)
    x = torch.cat([sweep * sign, torch.randn(100_000, generator=g) * 4, torch.tensor([math.inf, -math.inf, -0.0])])
    want, got = e2m1_decode(e2m1_encode(x)), E2M1.round(x.clone())
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.parametrize("fmt", [NVFP4(), MXFP4()], ids=["nvfp4", "mxfp4"])
def test_round_trip_is_dequantize_of_quantize_bit_for_bit(fmt, monkeypatch):
    x = gaussian_blocks(40, 64, seed=9).view(5, 8, 64)
    x[1, 2] = 0.0  # all-zero blocks: scale 0
    x[2, 3, :16] = -x[2, 3, :16].abs() * 1e-30  # underflowing blocks, negatives rounding to -0.0
    x[3, 4, :32] *= 1e4  # saturation
    for y in (x, x.transpose(0, 1), x.to(torch.bfloat16)):
        want = fmt.dequantize(fmt.quantize(y), dtype=y.dtype)
        got = fmt.round_trip(y)
        assert got.dtype == y.dtype and torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    assert torch.equal(fmt.round_trip(x, torch.bfloat16), fmt.dequantize(fmt.quantize(x), torch.bfloat16))
    monkeypatch.setattr(block_format, "CHUNK_ELEMS", 3 * 64)  # chunking over rows does not change the result
    assert torch.equal(fmt.round_trip(x), fmt.dequantize(fmt.quantize(x)))
    x[0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        fmt.round_trip(x)
