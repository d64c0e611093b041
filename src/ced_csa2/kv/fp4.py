"""FP4 storage formats for KV entries, written from their definitions in plain torch (design §7).

Two block formats share one 4-bit element type and differ only in the block scale
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

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .kv_bytes import fp4_entry_bytes

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

# Rows are processed in chunks of about this many elements (bounds temporaries, stays in cache).
_CHUNK_ELEMS = 1 << 18


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

def e4m3_scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4 block-scale bytes: ``amax / 6`` rounded to E4M3 as ``torch.float8_e4m3fn`` rounds.

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

    Returns
    -------
    torch.Tensor, shape (...), uint8
        The ``torch.float8_e4m3fn`` bit patterns (always positive: bit 7 clear).
    """
    scale = (amax / E2M1_MAX).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where((scale == 0) & (amax > 0), torch.ones_like(scale), scale)


def e4m3_scale_values(scale_bytes: torch.Tensor) -> torch.Tensor:
    """float32 values of E4M3 scale bytes, shape preserved."""
    return scale_bytes.view(torch.float8_e4m3fn).to(torch.float32)


def e8m0_scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """MXFP4 block-scale bytes: the biased exponent of ``2^(floor(log2 amax) − 2)``.

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

    Returns
    -------
    torch.Tensor, shape (...), uint8
        ``floor(log2 amax) − 2 + 127``, clamped to ``[0, 254]``.
    """
    _, exponent = torch.frexp(amax)  # amax = m · 2^e, m in [0.5, 1): floor(log2 amax) = e − 1
    biased = (exponent - 1 - E2M1_EMAX + E8M0_BIAS).clamp(0, 254)
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


# ----------------------------------------------------------------------------- packed entries

@dataclass(frozen=True)
class Packed:
    """FP4-packed entries: element bytes, scale bytes, and what is needed to unpack them.

    Attributes
    ----------
    elements : torch.Tensor, shape (..., D/2), uint8
        E2M1 codes, two per byte, low nibble = even channel.
    scales : torch.Tensor, shape (..., D/G), uint8
        One scale byte per group of ``G`` channels (E4M3 or E8M0 bit patterns).
    shape : torch.Size
        Shape of the quantised tensor, ``(..., D)``.
    group : int
        ``G``, channels per scale.
    scale_kind : str
        ``"e4m3"`` or ``"e8m0"``.
    """

    elements: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    group: int
    scale_kind: str

    def __post_init__(self):
        d = self.shape[-1]
        lead = tuple(self.shape[:-1])
        if tuple(self.elements.shape) != lead + (d // 2,) or self.elements.dtype != torch.uint8:
            raise ValueError(f"elements must be uint8 of shape {lead + (d // 2,)}, "
                             f"got {self.elements.dtype} {tuple(self.elements.shape)}")
        if tuple(self.scales.shape) != lead + (d // self.group,) or self.scales.dtype != torch.uint8:
            raise ValueError(f"scales must be uint8 of shape {lead + (d // self.group,)}, "
                             f"got {self.scales.dtype} {tuple(self.scales.shape)}")

    @property
    def entries(self) -> int:
        """Number of ``D``-channel entries (product of the leading dimensions)."""
        n = 1
        for s in self.shape[:-1]:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Stored bytes: ``elements.nbytes + scales.nbytes`` = ``entries · fp4_entry_bytes(D, G)``."""
        return self.elements.nbytes + self.scales.nbytes


def _check_shape(d: int, group: int) -> None:
    if group < 1 or d % group or d % 2:
        raise ValueError(f"FP4 packing needs the channel count D to be even and divisible by the group "
                         f"size G: got D = {d}, G = {group}")


@dataclass(frozen=True)
class _BlockFP4:
    """Shared quantise/dequantise of the two block formats (E2M1 elements, one scale byte per group)."""

    group: int
    scale_kind: str = field(init=False)

    def __post_init__(self):
        if not isinstance(self.group, int) or self.group < 1:
            raise ValueError(f"group must be a positive int, got {self.group!r}")

    # subclasses: amax (n, D/G) float32 -> bytes (n, D/G) uint8; bytes -> float32 values
    def _scale_bytes(self, amax: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _scale_values(self, scale_bytes: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _rows(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """``x`` ``(..., D)``, checked for ``what`` (a floating tensor whose ``D`` fits the group), as ``(N, D)``."""
        if not x.is_floating_point():
            raise TypeError(f"{what} expects a floating tensor, got {x.dtype}")
        if x.dim() == 0:
            raise ValueError(f"{what} expects a tensor of shape (..., D), got a scalar")
        _check_shape(x.shape[-1], self.group)
        return x.reshape(-1, x.shape[-1])

    def _blocks(self, flat: torch.Tensor, what: str):
        """Chunks of ``flat`` ``(N, D)``: ``(start, blocks, amax)``, ``blocks`` ``(rows, D/G, G)`` float32 of the
        rows from ``start`` and ``amax`` ``(rows, D/G)`` their block maxima (finite, else ValueError naming ``what``)."""
        d, g = flat.shape[1], self.group
        rows = max(1, _CHUNK_ELEMS // d)
        for start in range(0, flat.shape[0], rows):
            blocks = flat[start:start + rows].to(torch.float32).view(-1, d // g, g)
            amax = blocks.abs().amax(dim=-1)
            if not torch.isfinite(amax).all():
                raise ValueError(f"{type(self).__name__}.{what}: input holds NaN or Inf "
                                 f"(rows {start}..{start + blocks.shape[0] - 1} of the flattened (N, D))")
            yield start, blocks, amax

    def entry_bytes(self, channels: int) -> int:
        """Bytes of one ``channels``-wide entry: ``fp4_entry_bytes(channels, group)``."""
        _check_shape(channels, self.group)
        return fp4_entry_bytes(channels, self.group)

    def quantize(self, x: torch.Tensor) -> Packed:
        """Quantise entries to packed E2M1 elements with one scale byte per group.

        Per group of ``G`` channels: ``scale`` from the group's ``amax = max |x|`` (see the
        subclass), ``element = e2m1(x / scale)`` (round to nearest even, saturating).
        Computed in float32, in chunks of rows.

        Parameters
        ----------
        x : torch.Tensor, shape (..., D), floating
            ``D`` even and divisible by ``G``; finite.

        Returns
        -------
        Packed
            ``elements`` (..., D/2) and ``scales`` (..., D/G), uint8.

        Raises
        ------
        ValueError
            If ``D`` does not fit ``G``, or ``x`` holds NaN or Inf.
        """
        flat = self._rows(x, "quantize")
        (n, d), g = flat.shape, self.group
        elements = torch.empty(n, d // 2, dtype=torch.uint8, device=x.device)
        scales = torch.empty(n, d // g, dtype=torch.uint8, device=x.device)
        for start, blocks, amax in self._blocks(flat, "quantize"):
            sb = self._scale_bytes(amax)
            scale = self._scale_values(sb)
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero blocks: 0 / 1
            codes = _e2m1_codes(blocks / scale.unsqueeze(-1)).view(-1, d)
            end = start + codes.shape[0]
            elements[start:end], scales[start:end] = pack_nibbles(codes), sb
        lead = tuple(x.shape[:-1])
        return Packed(elements.view(*lead, d // 2), scales.view(*lead, d // g), x.shape, g, self.scale_kind)

    def round_trip(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``dequantize(quantize(x), dtype)`` bit for bit, without packing and unpacking the codes.

        What reading ``x`` back from storage gives, for the runtimes that only need the values
        (Mode B's FP4 groups, on every layer of ``baseline_fp4``): the same scales and
        element rounding, the element values taken straight from the rounding
        (:func:`_e2m1_round`) instead of codes packed into bytes and decoded again.

        Parameters
        ----------
        x : torch.Tensor, shape (..., D), floating
            As for :meth:`quantize`.
        dtype : torch.dtype, optional
            Output dtype (default ``x``'s); the product is formed in float32 and then cast.

        Returns
        -------
        torch.Tensor, shape (..., D), ``dtype``

        Raises
        ------
        ValueError
            As :meth:`quantize`.
        """
        flat = self._rows(x, "round_trip")
        out = torch.empty(flat.shape, dtype=dtype or x.dtype, device=x.device)
        for start, blocks, amax in self._blocks(flat, "round_trip"):
            scale = self._scale_values(self._scale_bytes(amax))  # the decoded scale: 0 for all-zero blocks
            divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
            values = (_e2m1_round(blocks / divisor) * scale.unsqueeze(-1)).flatten(1)
            out[start:start + values.shape[0]] = values
        return out.view(x.shape)

    def dequantize(self, packed: Packed, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decode packed entries: ``e2m1_value(code) · scale`` per channel.

        Parameters
        ----------
        packed : Packed
            From :meth:`quantize` of a format with the same group and scale kind.
        dtype : torch.dtype
            Output dtype; the product is formed in float32 and then cast.

        Returns
        -------
        torch.Tensor, shape packed.shape = (..., D), ``dtype``
        """
        if packed.group != self.group or packed.scale_kind != self.scale_kind:
            raise ValueError(f"{self!r} cannot decode a Packed with group {packed.group} "
                             f"and {packed.scale_kind} scales")
        d, g = packed.shape[-1], self.group
        el = packed.elements.reshape(-1, d // 2)
        sc = packed.scales.reshape(-1, d // g)
        n = el.shape[0]
        out = torch.empty(n, d, dtype=dtype, device=el.device)
        pairs = _BYTE_PAIRS.to(el.device)
        rows = max(1, _CHUNK_ELEMS // d)
        for start in range(0, n, rows):
            values = F.embedding(el[start:start + rows].to(torch.int64), pairs).view(-1, d // g, g)
            scale = self._scale_values(sc[start:start + rows]).unsqueeze(-1)
            out[start:start + rows] = (values * scale).view(-1, d)
        return out.view(packed.shape)


@dataclass(frozen=True)
class NVFP4(_BlockFP4):
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
    scale_kind: str = field(default="e4m3", init=False)

    def _scale_bytes(self, amax):
        return e4m3_scale_bytes(amax)

    def _scale_values(self, scale_bytes):
        return e4m3_scale_values(scale_bytes)


@dataclass(frozen=True)
class MXFP4(_BlockFP4):
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
    scale_kind: str = field(default="e8m0", init=False)

    def _scale_bytes(self, amax):
        return e8m0_scale_bytes(amax)

    def _scale_values(self, scale_bytes):
        return e8m0_scale_values(scale_bytes)


FORMATS = {"nvfp4": NVFP4, "mxfp4": MXFP4}
