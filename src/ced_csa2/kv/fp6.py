"""FP6 (E2M3) block formats: more bits for K where FP4 rounds keys too coarsely.

The codec :data:`E2M3` with :mod:`ced_csa2.kv.fp4`'s two scale rules (:class:`~ced_csa2.kv.block_format.BlockFormat`).

Keys need more bits than values (KV-AdaQuant; on the embedded default NVFP4 with rotation
costs far more ΔPPL on K alone than on V alone: ``studies/kv_formats``).  These formats store
OCP FP6 E2M3 elements -- 1 sign, 2 exponent (bias 1), 3 mantissa bits: magnitudes 0, 1/8 .. 7/8
(subnormal), 1 .. 7.5 -- with one scale byte per block of ``group`` channels:

* :class:`MXFP6` -- OCP MXFP6 E2M3: an **E8M0** (power-of-two) scale per 32 channels, the
  scale rule of :func:`ced_csa2.kv.fp4.e8m0_scale_bytes` (E2M3's largest exponent is 2, as E2M1's);
* :class:`FP6` -- the same elements with NVFP4's **E4M3** scale (``amax / 7.5`` rounded as
  ``torch.float8_e4m3fn`` rounds; no per-tensor scale, as :class:`~ced_csa2.kv.fp4.NVFP4`).

Elements pack four to three bytes (little-endian 24-bit words, channel ``4i`` in the low six
bits), so an entry of ``D`` channels costs ``3D/4 + D/G`` bytes
(:meth:`~ced_csa2.kv.block_format.BlockFormat.entry_bytes`).
Rounding is to nearest, ties to even, saturating at ±7.5; a NaN or Inf input is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .block_format import BlockFormat, ElementCodec, ScaleRule
from .fp4 import E4M3_SCALE, E8M0_SCALE

E2M3_MAX = 7.5
E2M3_EMAX = 2  # largest normal 7.5 = 1.875 · 2^2, as E2M1's exponent
# Magnitudes of codes 0..31 (bit 4..3 exponent, bits 2..0 mantissa); code | 32 is the negative.
E2M3_MAGNITUDES = torch.tensor([m / 8 for m in range(8)] + [(1 + m / 8) * 2.0 ** (e - 1)
                                                           for e in (1, 2, 3) for m in range(8)])
E2M3_VALUES = torch.cat([E2M3_MAGNITUDES, -E2M3_MAGNITUDES])


def e2m3_encode(x: torch.Tensor) -> torch.Tensor:
    """Codes 0..63 (bit 5 = sign) of the E2M3 values nearest to ``x``: ties to even, saturating at ±7.5.

    For ``a = min(|x|, 7.5)`` in the binade ``[2^e, 2^(e+1))`` the grid spacing is ``2^(e-3)``
    (three mantissa bits), below 1 it is 1/8 (subnormals continue the first binade's grid).
    Adding ``M = 2^(max(e, 0) + 20)``, whose float32 spacing is that grid's, rounds ``a`` to it
    with float32's round-to-nearest-even; ``k = a / spacing`` rounded is the bit-pattern
    difference, and the code is ``k + 8 · max(e, 0)``; its last bit is ``k``'s parity, so ties go
    to the even code (as :func:`ced_csa2.kv.fp4.e2m1_encode` does with one mantissa bit).
    """
    x = x.to(torch.float32)
    if not torch.isfinite(x).all():
        raise ValueError("e2m3_encode: input holds NaN or Inf")
    return _e2m3_codes(x)


def _e2m3_codes(x: torch.Tensor) -> torch.Tensor:
    """:func:`e2m3_encode` of finite float32 ``x`` without the check."""
    a = x.abs().clamp_(max=E2M3_MAX)
    magic_bits = (a.view(torch.int32) & 0x7F800000).clamp_(min=127 << 23).add_(20 << 23)  # bits of M
    k = a.add_(magic_bits.view(torch.float32)).view(torch.int32).sub_(magic_bits)
    codes = k.add_((magic_bits >> 23).sub_(127 + 20).mul_(8)).to(torch.uint8)
    return codes | (torch.signbit(x).to(torch.uint8) << 5)


def e2m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M3 codes 0..63 (code 32 is ``-0.0``)."""
    if codes.is_floating_point() or codes.is_complex():
        raise TypeError(f"e2m3_decode expects integer codes, got {codes.dtype}")
    c = codes.to(torch.int64)
    magnitude = E2M3_MAGNITUDES.to(codes.device)[c & 31]
    return torch.where((c & 32) > 0, -magnitude, magnitude)


def pack_sextets(codes: torch.Tensor) -> torch.Tensor:
    """``(..., D)`` 6-bit codes (``D`` divisible by 4) as ``(..., 3D/4)`` bytes: four codes per 24-bit word."""
    if codes.shape[-1] % 4:
        raise ValueError(f"pack_sextets: the last dimension must be divisible by 4, got {codes.shape[-1]}")
    c = codes.to(torch.int32).view(*codes.shape[:-1], -1, 4)
    word = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
    return torch.stack([word & 0xFF, (word >> 8) & 0xFF, word >> 16], dim=-1).flatten(-2).to(torch.uint8)


def unpack_sextets(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_sextets`: ``(..., 3D/4)`` bytes to ``(..., D)`` uint8 codes."""
    b = packed.to(torch.int32).view(*packed.shape[:-1], -1, 3)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    return torch.stack([(word >> s) & 63 for s in (0, 6, 12, 18)], dim=-1).flatten(-2).to(torch.uint8)


def _e2m3_round(x: torch.Tensor) -> torch.Tensor:
    """float32 values of the E2M3 codes of finite float32 ``x``."""
    return e2m3_decode(_e2m3_codes(x))


def _e2m3_values(packed: torch.Tensor) -> torch.Tensor:
    """float32 values ``(..., D)`` of packed E2M3 bytes ``(..., 3D/4)``."""
    return e2m3_decode(unpack_sextets(packed))


E2M3 = ElementCodec("e2m3", bits=6, max=E2M3_MAX, emax=E2M3_EMAX, codes=_e2m3_codes, round=_e2m3_round,
                    pack=pack_sextets, values=_e2m3_values)


@dataclass(frozen=True)
class FP6(BlockFormat):
    """E2M3 elements, one E4M3 scale ``amax / 7.5`` per ``group`` (16) channels (NVFP4's scale rule)."""

    group: int = 16
    element: ClassVar[ElementCodec] = E2M3
    scale: ClassVar[ScaleRule] = E4M3_SCALE


@dataclass(frozen=True)
class MXFP6(BlockFormat):
    """OCP MXFP6 E2M3: one E8M0 scale ``2^(floor(log2 amax) − 2)`` per ``group`` (32) channels."""

    group: int = 32
    element: ClassVar[ElementCodec] = E2M3
    scale: ClassVar[ScaleRule] = E8M0_SCALE
