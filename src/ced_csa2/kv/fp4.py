"""FP4 storage formats for KV entries, written from their definitions in plain torch (design §7).

Two block formats (:class:`~ced_csa2.kv.block_format.BlockFormat`) share one 4-bit element type,
the codec :data:`E2M1`, and differ only in the block scale, :data:`E4M3_SCALE` or :data:`E8M0_SCALE`
(seed 003 §4.4):

* :class:`NVFP4` — E2M1 elements with one **E4M3** scale per 16 channels, the main-KV
  format of DeepSeek-V4.1: "NVFP4 without its second-level (global) scale";
* :class:`MXFP4` — OCP MXFP4: E2M1 elements with one **E8M0** (power-of-two) scale per 32
  channels, the indexer-K format.

An entry of ``D`` channels in groups of ``G`` packs into ``D/2`` element bytes plus
``D/G`` scale bytes, exactly :func:`ced_csa2.kv.kv_bytes.fp4_entry_bytes` (288 B for
``(512, 16)``, 68 B for ``(128, 32)``).

References
----------
.. [MX] Open Compute Project, *OCP Microscaling Formats (MX) Specification*, v1.0,
   September 2023: the FP4 E2M1 element type, the E8M0 scale type and the conversion
   of a vector of scalars to an MX block (``shared_exp = floor(log2(max|V_i|)) −
   emax_elem``, ``emax_elem = 2`` for E2M1; elements quantised as ``V_i / 2^shared_exp``
   with round-to-nearest-even, clamped to the largest normal).
.. [NV] NVIDIA, *Introducing NVFP4 for Efficient and Accurate Low-Precision Inference*,
   NVIDIA Technical Blog, 2025: E2M1 elements, one E4M3 scale per 16-element block
   (``amax / 6`` rounded to E4M3), and a second-level FP32 per-tensor scale.  This
   module's :class:`NVFP4` omits the per-tensor scale, as the seeds do (see there).

E2M1 codes
----------
A code is 4 bits ``s e1 e0 m`` (sign, two exponent bits with bias 1, one mantissa bit;
``e = 0`` is subnormal).  Codes 0..7 are the magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6``
in order; codes 8..15 are the same magnitudes negated (code 8 is ``-0.0``).  The
mantissa bit is the code's lowest bit, so "ties to even" means "ties to the even code".

Byte order of packed codes: element ``2i`` sits in the **low** nibble of byte ``i`` and
element ``2i + 1`` in the high nibble (the order of the MX spec's packed FP4 and of
``torch.float4_e2m1fn_x2``).

Non-finite inputs: E2M1 has no Inf or NaN.  :func:`e2m1_encode` saturates ``±inf`` to
``±6`` and raises :class:`ValueError` on NaN; the block formats raise
:class:`ValueError` on any NaN or Inf in the input (a stored cache never holds them,
and silently storing a NaN block would poison every read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .block_format import BlockFormat, ElementCodec, ScaleRule

# Magnitudes of E2M1 codes 0..7 (seed 003 §4.4; [MX] FP4 E2M1).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
# All 16 codes as float32: 0..7 positive, 8..15 negative (8 is -0.0).
E2M1_VALUES = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float32)

E4M3_MAX = 448.0            # largest finite torch.float8_e4m3fn (byte 0x7E)
E4M3_MIN_SUBNORMAL = 2.0 ** -9  # smallest positive torch.float8_e4m3fn (byte 0x01)
E8M0_BIAS = 127
E2M1_EMAX = 2               # [MX]: emax_elem of E2M1 (largest normal 6 = 1.5 · 2^2)

# Per packed byte, the float32 values of its (low, high) nibbles: one gather decodes a byte.
_BYTE_PAIRS = torch.stack((E2M1_VALUES[torch.arange(256) & 0xF], E2M1_VALUES[torch.arange(256) >> 4]), dim=-1)


# ----------------------------------------------------------------------------- E2M1 elements

def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Codes of float32 ``x`` without a NaN check: round to nearest even, saturating to ±6.

    Rounding is done by the float adder.  For ``a = min(|x|, 6)`` in the binade
    ``[2^e, 2^(e+1))``, E2M1's grid spacing is ``2^(e-1)`` (one mantissa bit); below 1 it is
    0.5, the spacing of ``e = 0`` (E2M1 subnormals continue the first binade's grid).  Let
    ``M = 2^(max(e, 0) + 22)``: float32's spacing at ``M`` is ``2^(max(e, 0) − 1)``, so
    ``a + M`` rounds ``a`` to that grid with float32's round-to-nearest-even, giving
    ``M + k · spacing`` with ``k = a / spacing`` rounded, ties to even ``k``.  ``k`` is the
    difference of the bit patterns of ``a + M`` and ``M``, and the code is
    ``k + 2 · max(e, 0)`` (``k`` in {0, 1, 2} below 2, {2, 3, 4} on [2, 4), {2, 3} on
    [4, 6]); its mantissa bit is ``k``'s parity, so ties to even ``k`` are ties to the even
    code.  Checked against a brute-force nearest-value search in the tests.
    """
    a = x.abs().clamp_(max=E2M1_MAX)
    magic_bits = (a.view(torch.int32) & 0x7F800000).clamp_(min=127 << 23).add_(22 << 23)  # bits of M
    k_plus = a.add_(magic_bits.view(torch.float32)).view(torch.int32).sub_(magic_bits)  # k
    codes = k_plus.add_(magic_bits >> 22).sub_((127 + 22) << 1).to(torch.uint8)  # + 2 · max(e, 0)
    return codes | (torch.signbit(x).to(torch.uint8) << 3)


def _e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """``e2m1_decode(_e2m1_codes(x))`` for float32 ``x``, bit for bit, without forming the codes.

    :func:`_e2m1_codes` rounds ``a = min(|x|, 6)`` by adding ``M``; ``(a + M) − M`` is then
    exactly the grid value ``k · spacing`` its code decodes to (both operands lie in
    ``[M, 2M)``, so the subtraction is exact), and the code's sign bit is ``x``'s
    (``-0.0`` for negatives that round to zero, as code 8 decodes).  Same float
    operations, no integer codes: a round trip needs the values, not the bytes.
    """
    a = x.abs().clamp_(max=E2M1_MAX)
    magic = (a.view(torch.int32) & 0x7F800000).clamp_(min=127 << 23).add_(22 << 23).view(torch.float32)  # M
    return torch.copysign(a.add_(magic).sub_(magic), x)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round values to the nearest E2M1 code.

    Round-to-nearest with ties to even (to the code whose mantissa bit is 0, i.e. the
    even code: 0.25 → 0, 0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4, 5 → 4);
    magnitudes above 6 (including ``inf``) saturate to ±6.  The sign is kept for
    values that round to zero: ``-0.0`` and ``-0.1`` both encode to code 8 (``-0``).

    Parameters
    ----------
    x : torch.Tensor, shape (...)
        Any floating dtype; converted to float32 first (float64 inputs are thus rounded
        to float32 before being rounded to E2M1).

    Returns
    -------
    torch.Tensor, shape (...), uint8
        Codes 0..15 (bit 3 = sign, bits 2..1 = exponent, bit 0 = mantissa).

    Raises
    ------
    ValueError
        If ``x`` holds a NaN (E2M1 has no NaN encoding).
    """
    x = x.to(torch.float32)
    if torch.isnan(x).any():
        raise ValueError("e2m1_encode: input holds NaN, which E2M1 cannot represent")
    return _e2m1_codes(x)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """Values of E2M1 codes.

    Parameters
    ----------
    codes : torch.Tensor, shape (...), integer
        Codes 0..15 (code 8 decodes to ``-0.0``).

    Returns
    -------
    torch.Tensor, shape (...), float32
    """
    if codes.is_floating_point() or codes.is_complex():
        raise TypeError(f"e2m1_decode expects integer codes, got {codes.dtype}")
    return E2M1_VALUES.to(codes.device)[(codes.to(torch.int64) & 0xF)]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two per byte along the last dimension.

    Element ``2i`` goes to the low nibble of byte ``i``, element ``2i + 1`` to its high
    nibble.

    Parameters
    ----------
    codes : torch.Tensor, shape (..., D), uint8
        Values 0..15 (higher bits are dropped); ``D`` even.

    Returns
    -------
    torch.Tensor, shape (..., D/2), uint8
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dimension, got D = {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`.

    Parameters
    ----------
    packed : torch.Tensor, shape (..., D/2), uint8

    Returns
    -------
    torch.Tensor, shape (..., D), uint8
        Codes 0..15, low nibble first.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_nibbles expects uint8 bytes, got {packed.dtype}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------- block scales

def e4m3_scale_bytes(amax: torch.Tensor, element_max: float = E2M1_MAX) -> torch.Tensor:
    """NVFP4 block-scale bytes: ``amax / 6`` rounded to E4M3 as ``torch.float8_e4m3fn`` rounds.

    ``6`` is E2M1's largest magnitude, ``element_max``: another element type scales its blocks
    to its own (FP6's 7.5).  The figures below are E2M1's.

    Rules at the edges of E4M3's range (no per-tensor scale can move a block into range):

    * all-zero block (``amax == 0``): byte ``0x00`` (scale 0; the elements are all zero
      and decode to zero);
    * underflow (``amax > 0`` but ``amax / 6`` rounds to E4M3 zero, i.e.
      ``amax / 6 <= 2^-10``): byte ``0x01``, the smallest subnormal ``2^-9``, so no
      element is divided by zero (``|x| / 2^-9 <= 3``: nothing saturates);
    * overflow (``amax / 6 > 448``): byte ``0x7E`` (448); the elements then saturate at
      ±6, i.e. values are clipped to ±2688 (seed 003 §4.5's bound).

    Parameters
    ----------
    amax : torch.Tensor, shape (...), float32
        Block maxima of ``|x|``, finite and ``>= 0``.
    element_max : float
        The element type's largest magnitude.

    Returns
    -------
    torch.Tensor, shape (...), uint8
        The ``torch.float8_e4m3fn`` bit patterns (always positive: bit 7 clear).
    """
    scale = (amax / element_max).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where((scale == 0) & (amax > 0), torch.ones_like(scale), scale)


def e4m3_scale_values(scale_bytes: torch.Tensor) -> torch.Tensor:
    """float32 values of E4M3 scale bytes, shape preserved."""
    return scale_bytes.view(torch.float8_e4m3fn).to(torch.float32)


def e8m0_scale_bytes(amax: torch.Tensor, emax: int = E2M1_EMAX) -> torch.Tensor:
    """MXFP4 block-scale bytes: the biased exponent of ``2^(floor(log2 amax) − 2)``.

    ``2`` is E2M1's ``emax_elem``, ``emax`` (FP6 E2M3's is 2 as well).

    ``floor(log2 amax)`` is taken exactly from ``torch.frexp`` (also for subnormal
    ``amax``).  The block maximum then lands in ``[4, 8)`` after scaling: values in
    ``(6, 8)`` saturate to ±6, as the [MX] conversion prescribes.

    Rules at the edges: all-zero block → byte 0 (``2^-127``; the elements are zero);
    exponents below −127 (``amax < 2^-125``) clamp to byte 0.  No finite float32
    ``amax`` can overflow (``floor(log2 amax) − 2 <= 125``); byte ``0xFF`` (NaN) is never
    produced.

    Parameters
    ----------
    amax : torch.Tensor, shape (...), float32
        Block maxima of ``|x|``, finite and ``>= 0``.
    emax : int
        The element type's ``emax_elem``.

    Returns
    -------
    torch.Tensor, shape (...), uint8
        ``floor(log2 amax) − 2 + 127``, clamped to ``[0, 254]``.
    """
    _, exponent = torch.frexp(amax)  # amax = m · 2^e, m in [0.5, 1): floor(log2 amax) = e − 1
    biased = (exponent - 1 - emax + E8M0_BIAS).clamp(0, 254)
    return torch.where(amax > 0, biased, torch.zeros_like(biased)).to(torch.uint8)


def e8m0_scale_values(scale_bytes: torch.Tensor) -> torch.Tensor:
    """float32 values ``2^(byte − 127)`` of E8M0 scale bytes, built bit-exactly.

    Byte 0 is ``2^-127``, a float32 subnormal (bit pattern ``0x00400000``); byte 255
    (NaN in E8M0) is rejected.
    """
    b = scale_bytes.to(torch.int32)
    if (b == 255).any():
        raise ValueError("E8M0 scale byte 0xFF is NaN; this module never writes it")
    bits = torch.where(b > 0, b << 23, torch.full_like(b, 1 << 22))
    return bits.view(torch.float32)


def _e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """float32 values ``(..., D)`` of packed E2M1 bytes ``(..., D/2)``: one gather per byte, low nibble first."""
    return F.embedding(packed.to(torch.int64), _BYTE_PAIRS.to(packed.device)).flatten(-2)


# ----------------------------------------------------------------------------- the codec and scale rules

E2M1 = ElementCodec("e2m1", bits=4, max=E2M1_MAX, emax=E2M1_EMAX, codes=_e2m1_codes, round=_e2m1_round,
                    pack=pack_nibbles, values=_e2m1_values)
# E4M3: amax / element max, rounded as torch.float8_e4m3fn rounds; E8M0: a power of two from amax's exponent.
E4M3_SCALE = ScaleRule("e4m3", lambda amax, element: e4m3_scale_bytes(amax, element.max), e4m3_scale_values)
E8M0_SCALE = ScaleRule("e8m0", lambda amax, element: e8m0_scale_bytes(amax, element.emax), e8m0_scale_values)


# ----------------------------------------------------------------------------- the formats

@dataclass(frozen=True)
class NVFP4(BlockFormat):
    """E2M1 elements with one E4M3 scale per ``group`` (16) channels, no per-tensor scale.

    Block scale ``s = e4m3(amax / 6)``, rounded exactly as ``torch.float8_e4m3fn`` rounds
    (round to nearest even), stored as its byte; elements ``e2m1(x / s)``.  Edge rules
    (all-zero, underflow, overflow) in :func:`e4m3_scale_bytes`.

    Differences from NVIDIA's NVFP4 [NV]: NVFP4 also stores one FP32 scale per tensor and
    forms the E4M3 block scales relative to it, which keeps them inside E4M3's range.
    Here, as in DeepSeek-V4.1's main-KV cache (seed 003 §4.4, "NVFP4 without the second
    level of global scaling"), there is none: block scales are absolute, so the largest
    storable magnitude is ``6 · 448 = 2688`` (seed 003 §4.5) and blocks with
    ``amax < 6 · 2^-6 = 0.09375`` get subnormal E4M3 scales (fewer scale bits).

    Error bound (normal scales, ``amax / 6 >= 2^-6``): every element is within half a
    code spacing of the scaled grid, ``|x − x̂| <= s · h(min(|x| / s, 6))`` with
    ``h = 0.25`` on ``[0, 2]``, ``0.5`` on ``(2, 4]``, ``1`` on ``(4, 6]``; rounding
    ``amax / 6`` to E4M3 is off by at most ``2^-4`` relative, so ``|x| / s <= 6.4`` and
    saturation costs at most ``0.4 s``.

    Parameters
    ----------
    group : int
        Channels per scale (16 in NVFP4 and in V4.1's main KV).
    """

    group: int = 16
    element: ClassVar[ElementCodec] = E2M1
    scale: ClassVar[ScaleRule] = E4M3_SCALE


@dataclass(frozen=True)
class MXFP4(BlockFormat):
    """OCP MXFP4 [MX]: E2M1 elements with one E8M0 scale per ``group`` (32) channels.

    Block scale ``s = 2^(floor(log2 amax) − 2)`` (``emax_elem = 2``), stored as the
    biased exponent byte (bias 127); elements ``e2m1(x / s)``, saturating.  Edge rules
    in :func:`e8m0_scale_bytes`.

    Error bound: ``|x| / s < 8``; for ``|x| / s <= 6`` every element is within half a
    code spacing, ``s · h(|x| / s)`` (``h`` as in :class:`NVFP4`); the saturated band
    ``(6, 8)`` costs up to (strictly less than) ``2 s``.

    Parameters
    ----------
    group : int
        Channels per scale (32 in OCP MXFP4 and in V4.1's indexer K).
    """

    group: int = 32
    element: ClassVar[ElementCodec] = E2M1
    scale: ClassVar[ScaleRule] = E8M0_SCALE
