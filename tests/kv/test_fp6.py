"""FP6 (E2M3) block formats against an independent implementation: nearest value with ties to even, the
scales as the two scale types define them, the packing, and the bytes a stream stores."""

import math

import pytest
import torch
from conftest import nearest_on_grid

from ced_csa2.kv.formats import StreamFormat
from ced_csa2.kv.fp6 import FP6, MXFP6, e2m3_decode, e2m3_encode, pack_sextets, unpack_sextets

# OCP FP6 E2M3, written out: subnormals m/8, then (1 + m/8) · 2^(E-1) for E = 1, 2, 3
MAGNITUDES = [0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1, 1.125, 1.25, 1.375, 1.5, 1.625, 1.75, 1.875,
              2, 2.25, 2.5, 2.75, 3, 3.25, 3.5, 3.75, 4, 4.5, 5, 5.5, 6, 6.5, 7, 7.5]
GRID = torch.tensor(MAGNITUDES)


def e2m3_reference(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M3 value of each element (saturating at 7.5); a tie goes to the even code."""
    return nearest_on_grid(v, GRID)


def test_e2m3_rounds_to_nearest_with_ties_to_even_and_saturates():
    mids = (GRID[1:] + GRID[:-1]) / 2  # every tie
    v = torch.cat([GRID, mids, torch.linspace(0, 9, 4001), torch.tensor([1e-30, 7.49, 7.75, 100.0])])
    v = torch.cat([v, -v])
    assert torch.equal(e2m3_decode(e2m3_encode(v)), e2m3_reference(v))
    assert e2m3_decode(e2m3_encode(torch.tensor([0.1875, 2.125, 7.25]))).tolist() == [0.25, 2.0, 7.0]  # even codes
    assert torch.signbit(e2m3_decode(e2m3_encode(torch.tensor([-0.01])))).item()  # -0 keeps its sign
    with pytest.raises(ValueError, match="NaN or Inf"):
        e2m3_encode(torch.tensor([1.0, float("nan")]))


def test_sextets_pack_four_codes_into_three_bytes_and_back():
    codes = torch.randint(0, 64, (3, 5, 192), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    packed = pack_sextets(codes.to(torch.uint8))
    assert packed.shape == (3, 5, 144) and packed.dtype == torch.uint8
    assert torch.equal(unpack_sextets(packed), codes.to(torch.uint8))
    # little-endian 24-bit words, the first code in the low six bits
    assert pack_sextets(torch.tensor([1, 2, 3, 63], dtype=torch.uint8)).tolist() == [
        1 | (2 << 6) & 0xFF, (2 >> 2) | (3 << 4) & 0xFF, (3 >> 4) | (63 << 2)]


def block_reference(x: torch.Tensor, group: int, scale_kind: str) -> torch.Tensor:
    """One block at a time: the scale as its type defines it, then every element to its nearest E2M3 value."""
    flat = x.reshape(-1, group)
    out = torch.empty_like(flat)
    for i, block in enumerate(flat):
        amax = block.abs().max()
        if scale_kind == "e4m3":  # NVFP4's rule with E2M3's largest value; underflow to the smallest subnormal
            scale = (amax / 7.5).to(torch.float8_e4m3fn).to(torch.float32)
            scale = torch.tensor(2.0 ** -9) if scale == 0 and amax > 0 else scale
        else:  # OCP MX: 2^(floor(log2 amax) - emax_elem), emax_elem = 2 for E2M3
            scale = torch.tensor(2.0 ** (math.floor(math.log2(amax)) - 2)) if amax > 0 else torch.tensor(0.0)
        scale = scale if scale > 0 else torch.tensor(1.0)
        out[i] = e2m3_reference(block / scale) * scale
    return out.view(x.shape)


@pytest.mark.parametrize("fmt", [FP6(16), FP6(32), MXFP6(32)], ids=lambda f: f"{type(f).__name__}{f.group}")
def test_block_fp6_round_trip_and_bytes_are_the_reference_s(fmt):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 192, generator=g) * torch.logspace(-3, 2, 192)  # blocks of very different ranges
    x[0, 0, :fmt.group] = 0  # an all-zero block
    packed = fmt.quantize(x)
    assert torch.equal(fmt.dequantize(packed), block_reference(x, fmt.group, fmt.scale_kind))
    entries = 2 * 7
    assert packed.nbytes == entries * fmt.entry_bytes(192) == entries * (3 * 192 // 4 + 192 // fmt.group)
    with pytest.raises(ValueError, match="divisible by 4"):
        fmt.quantize(torch.randn(3, fmt.group * 2 + 2))


@pytest.mark.parametrize("element, group, axis, bits", [("fp6", 32, "channels", 6.25), ("mxfp6", 32, "channels", 6.25),
                                                         ("fp6", 16, "tokens", 6.5), ("nvfp4", 16, "channels", 4.5)])
def test_a_stream_s_bytes_per_token_are_its_bits_per_value(element, group, axis, bits):
    assert StreamFormat(element, group, axis).bytes_per_token(192) == 192 * bits / 8


def test_a_token_axis_fp6_stream_round_trips_each_channel_s_blocks():
    x = torch.randn(1, 37, 64, generator=torch.Generator().manual_seed(2))
    got = StreamFormat("fp6", 8, "tokens").round_trip(x)
    padded = torch.nn.functional.pad(x.transpose(1, 2), (0, 3))  # 37 tokens -> 5 blocks of 8
    want = block_reference(padded, 8, "e4m3")[..., :37].transpose(1, 2)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="packed runs of 4"):
        StreamFormat("fp6", 6, "tokens").bytes_per_token(64)
