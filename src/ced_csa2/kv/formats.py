"""The registry of named stored-KV formats, and how a stream (K or V) of a layer is stored in one.

:data:`FORMATS` names every block format (:class:`~ced_csa2.kv.block_format.BlockFormat`: an element
codec and a scale rule): the E2M1 formats of :mod:`ced_csa2.kv.fp4` (``nvfp4`` with E4M3 scales,
``mxfp4`` with E8M0 scales) and the E2M3 formats of :mod:`ced_csa2.kv.fp6` (``fp6``, ``mxfp6``: more bits
for keys).  The pipeline's ``kv_format`` picks one of :data:`FP4_FORMATS` for the ``*_fp4`` groups;
a group's own ``stream_formats`` and the ``kv_formats`` study pick any by name.

NVFP4 as DeepSeek-V4.1 stores its main KV (:mod:`ced_csa2.kv.fp4`) scales each *token's*
entry in blocks of 16 channels.  Keys are not shaped for that: a few pre-RoPE key channels are
many times larger than the rest *for every token* (the outlier channels that
:mod:`ced_csa2.kv.rotation` spreads out), so a per-token block holding one of them rounds its
other channels coarsely.  KIVI (Liu et al., 2024) quantises keys **per channel**, one scale
for a channel's values over a block of consecutive tokens, and values per token; KVQuant
(Hooper et al., 2024) does the keys' per-channel step *before* RoPE, where a channel keeps
its scale across positions -- the injection point here (pre-k_norm, pre-RoPE).

A :class:`StreamFormat` is one stream's (K's or V's) format: a format of :data:`FORMATS` by name,
the block width ``group`` and the block's ``axis``:

* ``channels`` -- one scale per ``group`` channels of a token's entry (NVFP4, MXFP4);
* ``tokens`` -- one scale per channel for each block of ``group`` consecutive tokens.

Either way a stored token costs ``D · bits / 8`` element bytes plus ``D/group`` scale bytes
(:meth:`StreamFormat.bytes_per_token`), so the axis changes the quality, not the bytes.
``rotate`` applies the layer's randomised Hadamard rotation per head first (as the
``*_fp4_rot`` groups do).  ``exact`` keeps the first ``exact`` channels of every head as they
are, counted at 16 bits: on a partial-RoPE model (Qwen3.5: RoPE turns the first 64 of each
head's 256 key channels) the slice that carries position stays lossless and the block format
holds the rest (rotated over the rest, when ``rotate``).

Teacher forcing and the token axis.  :meth:`StreamFormat.round_trip` quantises a whole
sequence at once, so every key is read from its full block -- as every query after the
block has filled reads it.  A decode cache holds the newest, unfilled block's keys in full
precision until the block fills (KIVI's residual: at most ``(group - 1) · D`` dense entries
per layer, bounded, not per token), so the queries inside a block see *more* rounding here
than a decode does: the pessimistic side.  A partial last block is quantised on the tokens
it has (zero padding leaves a block's maximum, and so its scale, unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .block_format import BlockFormat
from .fp4 import E2M1, MXFP4, NVFP4
from .fp6 import FP6, MXFP6
from .rotation import HeadRotation, layer_rotation

# Every stored-KV block format by name; each is called with its group (or none: the format's default).
FORMATS: dict[str, type[BlockFormat]] = {"nvfp4": NVFP4, "mxfp4": MXFP4, "fp6": FP6, "mxfp6": MXFP6}
# The pipeline's kv_format choices: the FP4 (E2M1) formats the *_fp4 groups store.
FP4_FORMATS = {name: fmt for name, fmt in FORMATS.items() if fmt.element is E2M1}
AXES = ("channels", "tokens")


@dataclass(frozen=True)
class StreamFormat:
    """How one stream (K or V) of a layer is stored.

    Parameters
    ----------
    element
        A key of :data:`FORMATS`: ``nvfp4`` (E2M1 elements, E4M3 scales), ``mxfp4`` (E2M1, E8M0
        scales), ``fp6`` (E2M3, E4M3 scales) or ``mxfp6`` (E2M3, E8M0 scales).
    group
        Values per scale: channels (``axis: channels``) or tokens (``axis: tokens``).
    axis
        :data:`AXES`: what a block runs along.
    rotate
        Rotate each head by the layer's randomised Hadamard matrix before quantising.
    exact
        Channels at the start of every head kept as they are, 16 bits each (0: none).
    """

    element: str = "nvfp4"
    group: int = 16
    axis: str = "channels"
    rotate: bool = False
    exact: int = 0

    def __post_init__(self):
        if self.element not in FORMATS:
            raise ValueError(f"element {self.element!r}: choose one of {list(FORMATS)}")
        if self.axis not in AXES:
            raise ValueError(f"axis {self.axis!r}: choose one of {list(AXES)}")
        if not isinstance(self.group, int) or self.group < 1:
            raise ValueError(f"group must be a positive int, got {self.group!r}")
        if not isinstance(self.exact, int) or self.exact < 0:
            raise ValueError(f"exact must be an int >= 0 (channels per head), got {self.exact!r}")

    def _split(self, kv_dim: int, head_dim: int | None) -> tuple[int, int]:
        """``(n_heads, exact)``: the heads of ``kv_dim`` and the exact channels of each (checked)."""
        if not self.exact:
            return 1, 0
        if head_dim is None or kv_dim % head_dim or self.exact > head_dim:
            raise ValueError(f"{self}: exact channels need the head width ({head_dim}) of kv_dim {kv_dim}, "
                             f"at least {self.exact} wide")
        return kv_dim // head_dim, self.exact

    def bytes_per_token(self, kv_dim: int, head_dim: int | None = None) -> float:
        """Stored bytes per token of one ``kv_dim``-wide stream: ``kv_dim · bits / 8 + kv_dim/group``.

        On the token axis a scale is shared by ``group`` tokens; the figure is per token of
        whole blocks (a partial last block costs its scales in full).  With :attr:`exact`
        (``head_dim`` needed): ``2 · exact`` bytes per head plus the format's bytes of the rest.
        """
        heads, exact = self._split(kv_dim, head_dim)
        rest = kv_dim - heads * exact
        return 2 * heads * exact + (self._format_bytes(rest) if rest else 0.0)

    def _format_bytes(self, kv_dim: int) -> float:
        element = FORMATS[self.element].element
        bits, pack = element.bits, element.per_byte_run
        packed_axis = kv_dim if self.axis == "channels" else self.group
        if kv_dim % 2 or packed_axis % pack or (self.axis == "channels" and kv_dim % self.group):
            raise ValueError(f"{self}: kv_dim {kv_dim} does not split into packed runs of {pack} values and "
                             f"groups of {self.group}")
        return kv_dim * bits / 8 + kv_dim / self.group

    def round_trip(self, x: torch.Tensor, rotation: HeadRotation | None = None, head_dim: int | None = None
                   ) -> torch.Tensor:
        """What reading ``x`` back from this format gives.

        Parameters
        ----------
        x : torch.Tensor, shape (B, T, kv_dim), floating
            One stream of one layer at the injection point, tokens along ``T``.
        rotation
            The layer's rotation (of ``head_dim - exact`` channels); required when :attr:`rotate`.
        head_dim
            Each head's width; required when :attr:`exact`.

        Returns
        -------
        torch.Tensor, shape (B, T, kv_dim), ``x.dtype``: the exact channels bit for bit.
        """
        heads, exact = self._split(x.shape[-1], head_dim)
        if not exact:
            return self._rest_round_trip(x, rotation)
        if exact == head_dim:
            return x.clone()
        per_head = x.unflatten(-1, (heads, head_dim))
        rest = self._rest_round_trip(per_head[..., exact:].flatten(-2), rotation).unflatten(-1, (heads, -1))
        return torch.cat([per_head[..., :exact], rest], dim=-1).flatten(-2)

    def _rest_round_trip(self, x: torch.Tensor, rotation: HeadRotation | None) -> torch.Tensor:
        if self.rotate and rotation is None:
            raise ValueError(f"{self}: a rotated format needs the layer's rotation")
        fmt = FORMATS[self.element](self.group)
        y = rotation.rotate(x) if self.rotate else x.to(torch.float32)
        if self.axis == "channels":
            y = fmt.dequantize(fmt.quantize(y), dtype=y.dtype)
        else:
            t = y.shape[1]
            pad = -t % self.group
            cols = torch.nn.functional.pad(y.transpose(1, 2), (0, pad))  # (B, kv_dim, T + pad): blocks along T
            y = fmt.dequantize(fmt.quantize(cols), dtype=y.dtype)[..., :t].transpose(1, 2)
        return rotation.unrotate(y, dtype=x.dtype) if self.rotate else y.to(x.dtype)


@dataclass(frozen=True)
class KVFormat:
    """A layer's K and V formats (the same at every attention layer)."""

    k: StreamFormat
    v: StreamFormat

    def bytes_per_token(self, kv_dim: int, head_dim: int | None = None) -> float:
        """Stored bytes per token of one layer: K's plus V's (``head_dim``: needed by a stream's ``exact``)."""
        return self.k.bytes_per_token(kv_dim, head_dim) + self.v.bytes_per_token(kv_dim, head_dim)


def group_format(spec) -> KVFormat:
    """The :class:`KVFormat` of a group (:class:`~ced_csa2.groups.Group`) with its own ``stream_formats``
    (channel axis, no exact channels)."""
    if spec.stream_formats is None:
        raise ValueError(f"group {spec.name!r} has no stream_formats of its own (its FP4 entries follow kv_format)")
    return KVFormat(*(StreamFormat(s.element, s.group, rotate=s.rotate) for s in spec.stream_formats))


def format_replacements(fmt: KVFormat, layers, head_dim: int) -> dict:
    """``{(layer, "k" | "v"): out -> round_trip(out)}`` for :func:`ced_csa2.kv_hooks.inject`: each of ``layers``'
    K and V read back from ``fmt``, rotated by the layer's matrix where its stream says so."""
    streams = {"k": fmt.k, "v": fmt.v}
    # A stream with exact channels rotates the rest of each head only (the layer's seed all the same).
    rotations = {(layer, kind): layer_rotation(head_dim - s.exact, layer) if s.exact < head_dim else None
                 for layer in layers for kind, s in streams.items()}
    return {(layer, kind): lambda out, s=streams[kind], r=rotations[layer, kind]: s.round_trip(out, r, head_dim)
            for layer in layers for kind in "kv"}
