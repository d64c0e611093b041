"""One base for every stored-KV block format: an element codec and a scale rule, one scale byte per block.

A block format stores an entry of ``D`` channels as ``D`` elements of a small float type and one
scale byte per block of ``group`` consecutive channels (the OCP MX layout; NVFP4's first level).  Two
parts say everything about a format, as a quantised cache backend of transformers' ``cache_utils``
overrides only how it rounds:

* the **element codec** (:class:`ElementCodec`): the element type -- its bits, largest magnitude and
  exponent range -- how a float32 value rounds to a code, how codes pack into bytes, and back;
* the **scale rule** (:class:`ScaleRule`): how a block's ``amax = max |x|`` becomes its scale byte
  (given the element type it scales to) and what value that byte stands for.

:class:`BlockFormat` holds the rest, the same for every format: per block, ``scale`` from ``amax``,
elements ``codec(x / scale)``; read back as ``value(code) · scale``, formed in float32.  An entry
costs ``D · bits / 8 + D / group`` bytes (:meth:`BlockFormat.entry_bytes`).  A format is a small
subclass naming its codec, its rule and its default ``group`` (:mod:`ced_csa2.kv.fp4`,
:mod:`ced_csa2.kv.fp6`); :data:`ced_csa2.kv.formats.FORMATS` names them.

Non-finite inputs are refused (:class:`ValueError`): a stored cache never holds them, and silently
storing a NaN block would poison every read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

# Rows are processed in chunks of about this many elements (bounds temporaries, stays in cache).
CHUNK_ELEMS = 1 << 18


@dataclass(frozen=True)
class ElementCodec:
    """An element type and its four functions (all on float32 values and uint8 codes or bytes).

    Attributes
    ----------
    name
        ``e2m1`` (FP4), ``e2m3`` (FP6), ...
    bits
        Bits per element.
    max
        Largest magnitude; larger values saturate to it.
    emax
        Exponent of the largest normal (``max = m · 2^emax``): a power-of-two scale puts a block's
        ``amax`` at ``2^emax`` and above.
    codes
        ``x`` ``(..., D)`` finite float32 to uint8 codes ``(..., D)``: round to nearest, ties to even,
        saturating at ``±max``.
    round
        ``x`` ``(..., D)`` finite float32 to the float32 values its codes decode to, bit for bit, without
        forming the codes (a round trip needs the values, not the bytes).
    pack
        Codes ``(..., D)`` to bytes ``(..., D · bits / 8)``.
    values
        Bytes ``(..., D · bits / 8)`` to the float32 values ``(..., D)`` of their codes.
    """

    name: str
    bits: int
    max: float
    emax: int
    codes: Callable[[torch.Tensor], torch.Tensor]
    round: Callable[[torch.Tensor], torch.Tensor]
    pack: Callable[[torch.Tensor], torch.Tensor]
    values: Callable[[torch.Tensor], torch.Tensor]

    @property
    def per_byte_run(self) -> int:
        """Elements per whole number of bytes (2 for 4 bits, 4 for 6 bits): ``D`` must be a multiple."""
        return 8 // math.gcd(8, self.bits)


@dataclass(frozen=True)
class ScaleRule:
    """A block-scale type: one byte per block, from the block's ``amax`` and the element type it scales to.

    Attributes
    ----------
    kind
        ``e4m3`` or ``e8m0``.
    to_bytes
        ``(amax, element)``: ``amax`` ``(...)`` finite float32 ``>= 0`` to the scale bytes ``(...)`` uint8.
    to_values
        Scale bytes ``(...)`` to their float32 values (0 for an all-zero block's byte where the type has a zero).
    """

    kind: str
    to_bytes: Callable[[torch.Tensor, ElementCodec], torch.Tensor]
    to_values: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Packed:
    """Block-format entries as stored: element bytes, scale bytes, and the format that reads them back.

    Attributes
    ----------
    elements : torch.Tensor, shape (..., D · bits / 8), uint8
        The element codes, packed by the format's codec.
    scales : torch.Tensor, shape (..., D/G), uint8
        One scale byte per group of ``G`` channels.
    shape : torch.Size
        Shape of the quantised tensor, ``(..., D)``.
    format : BlockFormat
        What wrote them (its codec, scale rule and ``G``).
    """

    elements: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    format: BlockFormat

    def __post_init__(self):
        d = self.shape[-1]
        lead = tuple(self.shape[:-1])
        width = d * self.format.element.bits // 8
        if tuple(self.elements.shape) != lead + (width,) or self.elements.dtype != torch.uint8:
            raise ValueError(f"elements must be uint8 of shape {lead + (width,)}, "
                             f"got {self.elements.dtype} {tuple(self.elements.shape)}")
        if tuple(self.scales.shape) != lead + (d // self.group,) or self.scales.dtype != torch.uint8:
            raise ValueError(f"scales must be uint8 of shape {lead + (d // self.group,)}, "
                             f"got {self.scales.dtype} {tuple(self.scales.shape)}")

    @property
    def group(self) -> int:
        """``G``, channels per scale."""
        return self.format.group

    @property
    def scale_kind(self) -> str:
        """The scale type, ``e4m3`` or ``e8m0``."""
        return self.format.scale_kind

    @property
    def entries(self) -> int:
        """Number of ``D``-channel entries (product of the leading dimensions)."""
        return math.prod(self.shape[:-1])

    @property
    def nbytes(self) -> int:
        """Stored bytes: ``elements.nbytes + scales.nbytes`` = ``entries · format.entry_bytes(D)``."""
        return self.elements.nbytes + self.scales.nbytes


@dataclass(frozen=True)
class BlockFormat:
    """Quantise, read back and count one block format: :attr:`element` codes, a :attr:`scale` byte per ``group``.

    A subclass sets the two class attributes and a default ``group``.

    Parameters
    ----------
    group : int
        Channels per scale byte.
    """

    group: int
    element: ClassVar[ElementCodec]
    scale: ClassVar[ScaleRule]

    def __post_init__(self):
        if not isinstance(self.group, int) or self.group < 1:
            raise ValueError(f"group must be a positive int, got {self.group!r}")

    @property
    def scale_kind(self) -> str:
        """The scale type, ``e4m3`` or ``e8m0``."""
        return self.scale.kind

    def check_channels(self, d: int) -> None:
        """Refuse a channel count ``d`` that does not split into whole packed runs and whole groups."""
        run = self.element.per_byte_run
        if d % run or d % self.group:
            raise ValueError(f"{type(self).__name__} packing needs the channel count D divisible by {run} and by "
                             f"the group size G: got D = {d}, G = {self.group}")

    def entry_bytes(self, channels: int) -> int:
        """Bytes of one ``channels``-wide entry: ``channels · bits / 8 + channels / group``."""
        self.check_channels(channels)
        return channels * self.element.bits // 8 + channels // self.group

    def _rows(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """``x`` ``(..., D)``, checked for ``what`` (a floating tensor whose ``D`` fits the group), as ``(N, D)``."""
        if not x.is_floating_point():
            raise TypeError(f"{what} expects a floating tensor, got {x.dtype}")
        if x.dim() == 0:
            raise ValueError(f"{what} expects a tensor of shape (..., D), got a scalar")
        self.check_channels(x.shape[-1])
        return x.reshape(-1, x.shape[-1])

    def _blocks(self, flat: torch.Tensor, what: str):
        """Chunks of ``flat`` ``(N, D)``: ``(start, blocks, amax)``, ``blocks`` ``(rows, D/G, G)`` float32 of the
        rows from ``start`` and ``amax`` ``(rows, D/G)`` their block maxima (finite, else ValueError naming
        ``what``)."""
        d, g = flat.shape[1], self.group
        rows = max(1, CHUNK_ELEMS // d)
        for start in range(0, flat.shape[0], rows):
            blocks = flat[start:start + rows].to(torch.float32).view(-1, d // g, g)
            amax = blocks.abs().amax(dim=-1)
            if not torch.isfinite(amax).all():
                raise ValueError(f"{type(self).__name__}.{what}: input holds NaN or Inf "
                                 f"(rows {start}..{start + blocks.shape[0] - 1} of the flattened (N, D))")
            yield start, blocks, amax

    def quantize(self, x: torch.Tensor) -> Packed:
        """Quantise entries to packed elements with one scale byte per group.

        Per group of ``G`` channels: ``scale`` from the group's ``amax = max |x|`` (the scale rule),
        ``element = codec(x / scale)`` (round to nearest even, saturating; an all-zero block is
        divided by 1).  Computed in float32, in chunks of rows.

        Parameters
        ----------
        x : torch.Tensor, shape (..., D), floating
            ``D`` a multiple of the codec's packed run and of ``G``; finite.

        Returns
        -------
        Packed
            ``elements`` (..., D · bits / 8) and ``scales`` (..., D/G), uint8.

        Raises
        ------
        ValueError
            If ``D`` does not fit, or ``x`` holds NaN or Inf.
        """
        flat = self._rows(x, "quantize")
        (n, d), g = flat.shape, self.group
        width = d * self.element.bits // 8
        elements = torch.empty(n, width, dtype=torch.uint8, device=x.device)
        scales = torch.empty(n, d // g, dtype=torch.uint8, device=x.device)
        for start, blocks, amax in self._blocks(flat, "quantize"):
            sb = self.scale.to_bytes(amax, self.element)
            scale = self.scale.to_values(sb)
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero blocks: 0 / 1
            codes = self.element.codes(blocks / scale.unsqueeze(-1)).view(-1, d)
            end = start + codes.shape[0]
            elements[start:end], scales[start:end] = self.element.pack(codes), sb
        lead = tuple(x.shape[:-1])
        return Packed(elements.view(*lead, width), scales.view(*lead, d // g), x.shape, self)

    def round_trip(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``dequantize(quantize(x), dtype)`` bit for bit, without packing and unpacking the codes.

        What reading ``x`` back from storage gives, for the runtimes that only need the values: the
        same scales, the element values taken straight from the rounding (the codec's ``round``).

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
            scale = self.scale.to_values(self.scale.to_bytes(amax, self.element))  # 0 for all-zero E4M3 blocks
            divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
            values = (self.element.round(blocks / divisor) * scale.unsqueeze(-1)).flatten(1)
            out[start:start + values.shape[0]] = values
        return out.view(x.shape)

    def dequantize(self, packed: Packed, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decode packed entries: ``value(code) · scale`` per channel.

        Parameters
        ----------
        packed : Packed
            From :meth:`quantize` of this format (same class and group).
        dtype : torch.dtype
            Output dtype; the product is formed in float32 and then cast.

        Returns
        -------
        torch.Tensor, shape packed.shape = (..., D), ``dtype``
        """
        if packed.format != self:
            raise ValueError(f"{self!r} cannot decode entries packed by {packed.format!r}")
        d, g = packed.shape[-1], self.group
        el = packed.elements.reshape(-1, d * self.element.bits // 8)
        sc = packed.scales.reshape(-1, d // g)
        n = el.shape[0]
        out = torch.empty(n, d, dtype=dtype, device=el.device)
        rows = max(1, CHUNK_ELEMS // d)
        for start in range(0, n, rows):
            values = self.element.values(el[start:start + rows]).view(-1, d // g, g)
            scale = self.scale.to_values(sc[start:start + rows]).unsqueeze(-1)
            out[start:start + rows] = (values * scale).view(-1, d)
        return out.view(packed.shape)
