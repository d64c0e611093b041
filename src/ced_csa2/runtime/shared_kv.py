"""A KV cache that stores the CSA2 source layer's K/V once and recomputes every reader's K/V from it.

Mode B (:class:`~ced_csa2.ced_runtime.CEDModeBRuntime`) *substitutes* the targets' K/V but
still lets every layer cache its own copy, so CSA2's "four copies → one" saves no bytes
there.  :class:`SharedKVCache` turns it into real bytes (docs/design.md §2, *Shared store*):

* the plan's **source** layer stores its ``k_proj``/``v_proj`` outputs -- pre-k_norm,
  pre-RoPE, ``(B, T, kv_dim)`` each -- **once**, in the storage format chosen
  (:data:`STORAGES`: the model's dtype, or FP4 blocks, design §7);
* the **target** layers store **nothing**;
* on ``update`` the source and each target get K/V for *all* cached positions,
  recomputed from the store: target ``t`` maps it through its adapter (``csa2``,
  ``ced_csa2``) or reads it verbatim (``share_plain``), then applies its own k_norm and
  RoPE; the source applies its own k_norm and RoPE.  This read-time compute (adapters
  over all ``T`` positions at every decode step) is the price of the saved bytes.

A group with a :attr:`~ced_csa2.groups.Group.sink` (``ced_csa2_sink``) keeps each replaced
layer's own K/V at every row's first ``sink`` positions, as Mode B's
:func:`~ced_csa2.kv_hooks.keep_initial` does: the source's in the store, in place of its projection
(the position ids say which entries: a left-padded row keeps its own first tokens), and each target's
-- post-k_norm, post-RoPE, as its attention got them -- in a table of its own, ``sink`` entries per
row whatever the context, served in place of the adapted entries at those positions.

Every other attention layer is an ordinary ``DynamicLayer`` (or ``DynamicSlidingWindowLayer``);
Qwen3.5's linear-attention layers keep their ordinary recurrent state.

Per layer, as the model itself: each reader gets its own layer type's RoPE (Gemma-3 uses
theta 1e4 on sliding and 1e6 on full layers); a sliding-window reader gets only the last
``window - 1`` cached positions plus the new ones, exactly what ``DynamicSlidingWindowLayer``
hands attention (the model builds one sliding mask for all of them); and a sliding-window
source's store keeps only its last ``window - 1`` positions (the plan refuses a reader that
would need older ones).  :class:`FP4KVCache` keeps a sliding layer's window too.

The store is fed by forward hooks on the source's ``k_proj``/``v_proj``
(:meth:`SharedKVCache.feed`).  Under ``ced_csa2`` the same context also installs the CED
projection (Mode B's ``ced`` hooks), so the captured source K/V is already
``projector(H_split)``.

:class:`FP4KVCache` is the matching control, ``baseline_fp4``: every attention layer keeps
its own K/V (post-k_norm, post-RoPE, as ``DynamicLayer`` does) in FP4 -- quantised on
write, dequantised on read -- so the cost of FP4 and the cost of sharing can be told
apart (``baseline`` → ``baseline_fp4`` is FP4 alone; ``baseline`` → shared ``bf16`` is
sharing alone).

Rotated FP4 (the ``*_fp4_rot`` groups, ``rotate=True`` on either cache): each FP4 entry of the
streams :data:`~ced_csa2.kv.rotation.ROTATED_STREAMS` is stored as ``FP4(R x)`` per head, ``R``
the layer's fixed randomised Hadamard matrix (:func:`~ced_csa2.kv.rotation.stream_rotations`),
and read back as ``Rᵀ dequant(FP4(R x))``.  The store holds the rotated blocks, so its bytes
per token are the unrotated store's; ``R`` is a weight (built from a seed), never stored per
token.  In :class:`SharedKVCache` ``x`` is the source's pre-k_norm, pre-RoPE entry, rotated by
the source layer's ``R``: bit for bit what Mode B's ``csa2_fp4_rot`` / ``ced_csa2_fp4_rot``
round.  In :class:`FP4KVCache` ``x`` is what each ``DynamicLayer`` holds: V as Mode B's
``baseline_fp4_rot`` rounds it, but K after k_norm and RoPE, which Mode B rounds before them
-- the same caveat as the unrotated ``baseline_fp4``: same bytes, another rounding of K.

:class:`BlockKVCache`, which :class:`FP4KVCache` specialises, stores each stream in its own block
format (:class:`~ced_csa2.kv.formats.KVFormat`): ``baseline_k6v4_rot``'s K in FP6 and V in MXFP4,
each rotated per head by the layer's ``R``, from its ``stream_formats``.  Its ``x`` is
:class:`FP4KVCache`'s: V rounded as Mode B's ``baseline_k6v4_rot`` rounds it, K after k_norm
and RoPE (Mode B rounds it before them) -- same bytes, another rounding of K.

Limits: :class:`SharedKVCache` recomputes RoPE from cache positions, so it takes unpadded
batches and left-padded ones (``generate``'s, as lm-eval builds them): each row's left padding is
read from the prefill's position ids and later forwards must continue them; other position ids
are refused (:class:`FP4KVCache` stores post-RoPE K, so positions do not matter to it; the sparse
store takes unpadded batches only).  Neither
supports beam search, cropping or batch reshaping (refused with
:class:`NotImplementedError`).  FP4 groups run
along the flattened ``kv_dim`` (``n_kv_heads · head_dim``): inside one head whenever
``head_dim`` is a multiple of the group (SmolLM2: 64, Qwen3.5-4B: 256).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from .. import kv_hooks
from ..ced_runtime import CEDModeBRuntime, CEDParts, require_parts
from ..kv import rotation as kv_rotation
from ..kv.block_format import Packed
from ..kv.formats import FORMATS, FP4_FORMATS, KVFormat, StreamFormat
from ..kv.kv_bytes import StoredCopy, kv_copies, sink_copies
from ..kv.rotation import HeadRotation, layer_rotation, stream_rotations, work_dtype
from ..model_utils import Geometry, attention, geometry, layer_type, rope_fn, rotary
from ..plan import LayerPlan
from ..groups import GROUPS, SHARED_GROUPS, group as group_spec

KV = tuple[torch.Tensor, torch.Tensor]

# "bf16" is the model's own dtype (bf16 on the full profile; fp32 on an fp32 model): plain tensors.
STORAGES = ("bf16", *FP4_FORMATS)


def _format(storage: str):
    """The FP4 format object of ``storage``, or ``None`` for dense storage."""
    if storage not in STORAGES:
        raise ValueError(f"unknown storage {storage!r}; choose one of {list(STORAGES)}")
    return FP4_FORMATS[storage]() if storage in FP4_FORMATS else None


def _check_rotate(rotate: bool, fmt, storage: str) -> None:
    if rotate and fmt is None:
        raise ValueError(f"rotate=True rotates FP4 entries; storage {storage!r} is not FP4 ({list(FP4_FORMATS)})")


def _check_block_width(fmt, kv_dim: int) -> None:
    if fmt is not None and kv_dim % fmt.group:
        raise ValueError(f"{type(fmt).__name__} stores groups of {fmt.group} channels, which do not divide "
                         f"kv_dim = {kv_dim}")


# ----------------------------------------------------------------------------- token store

class TokenStore:
    """Entries ``(B, T, D)`` of one stream (K or V), grown along ``T``, dense or block-packed (FP4 or FP6).

    Appending writes into spare capacity reserved ``GROW`` positions at a time, so a decode
    step copies its one new entry (transformers' ``DynamicCache`` concatenates: a copy of all
    ``T`` entries per layer and step).  :attr:`data` and :attr:`used_bytes` are the entries
    written; :attr:`allocated_bytes` adds the reserve (fewer than ``GROW`` positions, like a
    vector's spare capacity).  The reserve is memory the store holds, so it counts in the bytes
    allocated (:func:`cache_bytes`), not in the bytes used; it is kept on purpose, for the
    in-place append.

    Parameters
    ----------
    fmt
        A block format on the channel axis (FP4: :class:`~ced_csa2.kv.fp4.NVFP4` /
        :class:`~ced_csa2.kv.fp4.MXFP4`; FP6: :class:`~ced_csa2.kv.fp6.FP6` / :class:`~ced_csa2.kv.fp6.MXFP6`),
        or ``None`` to keep plain tensors in the dtype they arrive in.
    rotation
        Packed only: each entry is stored as ``FP4(R x)`` (or FP6) per head and read as ``Rᵀ dequant(.)``
        (:mod:`ced_csa2.kv.rotation`); :attr:`data` holds the rotated blocks.  ``None``: unrotated.
    """

    GROW = 256

    def __init__(self, fmt=None, rotation: HeadRotation | None = None):
        if rotation is not None and fmt is None:
            # Without a block format the round trip RᵀR x is x: a rotation would cost two matmuls and change nothing.
            raise ValueError("TokenStore: a rotation applies to block-format entries; give an FP4 or FP6 format")
        self.fmt, self.rotation = fmt, rotation
        self._buffers: tuple[torch.Tensor, ...] = ()  # dense: (entries,); packed: (elements, scales); capacity along dim 1
        self._n = 0
        self._batch_shape: torch.Size | None = None  # (B, ·, D) of the entries, for Packed views
        self.dtype: torch.dtype | None = None  # dtype of the entries written (and read back)

    def __len__(self) -> int:
        return self._n

    @property
    def data(self) -> torch.Tensor | Packed | None:
        """The entries written, ``(B, T, D)`` (a view of the buffers), or ``None`` when empty."""
        if not self._buffers:
            return None
        views = [b[:, :self._n] for b in self._buffers]
        if self.fmt is None:
            return views[0]
        b, _, d = self._batch_shape
        return Packed(*views, torch.Size((b, self._n, d)), self.fmt)

    @property
    def used_bytes(self) -> int:
        """Bytes of the entries written: ``B·T·D·itemsize`` dense, ``B·T·fmt.entry_bytes(D)`` packed."""
        return 0 if self.data is None else self.data.nbytes

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the buffers: the entries written plus the reserve, ``B·C·D·itemsize`` (``C``, the capacity,
        a multiple of ``GROW`` after an append that grew it; ``T`` after :meth:`keep_last` cut it)."""
        return storage_bytes(self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The buffers holding the entries (dense: one; packed: elements and scales), reserve included."""
        return self._buffers

    def append(self, x: torch.Tensor) -> None:
        """Add entries ``x`` ``(B, q, D)`` at the end (always a copy: never a view of ``x``)."""
        if not self._buffers:
            self.dtype, self._batch_shape = x.dtype, x.shape
        if self.fmt is None:
            parts = (x,)
        else:
            packed = self.fmt.quantize(x if self.rotation is None else self.rotation.rotate(x))
            parts = (packed.elements, packed.scales)
        end = self._n + x.shape[1]
        if not self._buffers or end > self._buffers[0].shape[1]:
            capacity = -(-end // self.GROW) * self.GROW
            grown = []
            for i, part in enumerate(parts):
                buf = part.new_empty((part.shape[0], capacity, *part.shape[2:]))
                if self._buffers:
                    buf[:, :self._n] = self._buffers[i][:, :self._n]
                grown.append(buf)
            self._buffers = tuple(grown)
        for buf, part in zip(self._buffers, parts):
            buf[:, self._n:end] = part
        self._n = end

    def read(self, at: torch.Tensor | None = None) -> torch.Tensor:
        """Entries in the written dtype (dequantised, and un-rotated, when packed): all ``(B, T, D)``, or those at
        ``at``.

        ``at`` ``(B, n)`` indexes each row's entries (``(B, n, D)`` out); packed rows are gathered
        first and only those dequantised, so a sparse read costs ``n``, not ``T``, entries.
        """
        d = self.data
        if d is None:
            raise RuntimeError("read from an empty TokenStore")
        if at is not None:
            if self.fmt is None:
                return _rows(d, at)
            d = Packed(_rows(d.elements, at), _rows(d.scales, at), torch.Size((d.shape[0], at.shape[1], d.shape[2])),
                       d.format)
        if self.fmt is None:
            return d
        if self.rotation is None:
            return self.fmt.dequantize(d, self.dtype)
        # Dequantised in the rotation's working dtype, then un-rotated and cast: fp4_round_trip's
        # Rᵀ dequant(FP4(R x)) bit for bit (a bf16 dequantisation would round once more).
        return self.rotation.unrotate(self.fmt.dequantize(d, work_dtype(self.dtype)), self.dtype)

    def keep_last(self, n: int) -> None:
        """Forget all but the last ``n`` entries (a sliding window moving on); a copy, so memory is freed."""
        if len(self) <= n:
            return
        self._buffers = tuple(b[:, self._n - n:self._n].clone() for b in self._buffers)
        self._n = n

    def clear(self) -> None:
        self._buffers, self._n, self._batch_shape, self.dtype = (), 0, None, None


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``: each ``untyped_storage().nbytes()`` counted once.

    A view (a slice of a larger buffer, K and V sharing one tensor) costs its whole storage,
    and a storage shared by several tensors is counted once.
    """
    storages = {}
    for t in tensors:
        s = t.untyped_storage()
        storages.setdefault((s.device, s.data_ptr()), s.nbytes())
    return sum(storages.values())


def _rows(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """``x[b, at[b]]`` for every row ``b``: ``(B, T, D)`` and ``(B, n)`` -> ``(B, n, D)``."""
    return x.gather(1, at[..., None].expand(-1, -1, x.shape[-1]))


# ----------------------------------------------------------------------------- cache layers

class _ReadOnlyShape:
    """Cache-layer methods that would reshape or roll back stored entries: refused."""

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} supports plain incremental decoding only "
                                  "(no beam search, cropping, batch reshaping or offloading)")

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = offload = prefetch = _unsupported


class _Windowed:
    """Sequence length and mask sizes of a cache layer that counts its positions in ``seen``.

    With a ``window`` (a sliding-window layer) they are ``DynamicSlidingWindowLayer``'s: the
    model builds one sliding mask from the first sliding layer's cache, so every sliding
    layer must hand attention the same ``min(seen, window - 1) + new`` positions.
    """

    window: int | None = None
    seen: int = 0

    @property
    def is_sliding(self) -> bool:
        return self.window is not None

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.window is None:
            return self.seen + query_length, 0
        return min(self.seen, self.window - 1) + query_length, max(self.seen - self.window + 1, 0)


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``(B, T, n·head_dim)`` -> ``(B, n, T, head_dim)``, the layout attention reads."""
    return x.view(*x.shape[:2], -1, head_dim).transpose(1, 2)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``(B, n, T, head_dim)`` -> ``(B, T, n·head_dim)``, the injection-point layout."""
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)


class BlockLayer(_Windowed, _ReadOnlyShape, DynamicLayer):
    """A ``DynamicLayer`` (or, with a ``window``, ``DynamicSlidingWindowLayer``) whose K and V
    (post-k_norm, post-RoPE) are kept in block formats: ``k_fmt`` and ``v_fmt`` (FP4 or FP6).

    ``update`` quantises the new entries, appends them, and returns every position cached
    plus the new ones, dequantised, ``(B, n_kv, T, head_dim)`` each, in the input dtype;
    a sliding layer then keeps only the last ``window - 1``.  ``rotations`` (``{"k": R, "v": R}``,
    :func:`~ced_csa2.kv.rotation.stream_rotations`; empty: none) rotates a stream's entries per
    head before quantising and back after reading.
    """

    def __init__(self, k_fmt, v_fmt, window: int | None = None, rotations: dict[str, HeadRotation] | None = None):
        super().__init__()
        rotations = rotations or {}
        self.k_store, self.v_store = TokenStore(k_fmt, rotations.get("k")), TokenStore(v_fmt, rotations.get("v"))
        self.window, self.seen = window, 0

    @property
    def used_bytes(self) -> int:
        return self.k_store.used_bytes + self.v_store.used_bytes

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.k_store.tensors(), *self.v_store.tensors())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> KV:
        head_dim = key_states.shape[-1]
        # Stored as (B, T, kv_dim), like the shared store, so both group channels the same way.
        self.k_store.append(_flat(key_states))
        self.v_store.append(_flat(value_states))
        self.is_initialized = True
        self.seen += key_states.shape[-2]
        out = _heads(self.k_store.read(), head_dim), _heads(self.v_store.read(), head_dim)
        if self.window is not None:
            self.k_store.keep_last(self.window - 1)
            self.v_store.keep_last(self.window - 1)
        return out

    def reset(self) -> None:
        self.k_store.clear()
        self.v_store.clear()
        self.seen = 0


def row_offsets(update_kwargs: dict, cached: int, new: int, offsets: torch.Tensor) -> torch.Tensor:
    """Each row's left padding ``(B,)``, read from the position ids of a forward over cache positions
    ``cached .. cached+new-1``; refuses position ids that do not count from each row's first token.

    ``generate`` on a left-padded batch gives row ``b`` (``p_b`` pad tokens) position ids
    ``t - p_b`` at cache position ``t >= p_b`` (anything at the masked pads), so the first forward
    fixes ``p_b`` and every later one must continue it.  ``Cache.update`` forwards the attention's
    kwargs as ``kwargs=...``; models that pass ``position_ids`` there (Llama, Qwen3.5, Gemma-3) are
    checked, others are taken as unpadded (``offsets`` unchanged).

    Parameters
    ----------
    offsets : torch.Tensor, shape (B,)
        The rows' left padding so far (zeros before the first forward).
    """
    position_ids = update_kwargs.get("kwargs", {}).get("position_ids")
    if position_ids is None:
        return offsets
    at = torch.arange(cached, cached + new, device=position_ids.device)
    ids = position_ids.reshape(-1, position_ids.shape[-1]).expand(offsets.shape[0], -1)
    if ids.shape[-1] == new:
        if cached == 0:  # the prefill: a row's pads are the positions before its first token
            offsets = (new - 1 - ids[:, -1]).clamp(min=0).to(offsets.device)
        real = at[None] >= offsets[:, None].to(at.device)
        if bool((ids == at[None] - offsets[:, None].to(at.device))[real].all()):
            return offsets
    starts = ids[:, 0].tolist()
    raise ValueError("SharedKVCache recomputes RoPE from cache positions: it takes unpadded or left-padded batches "
                     f"whose position ids count from each row's first token; got position ids starting at {starts} "
                     f"(per row) for cache positions {cached}..{cached + new - 1}")


class SharedStore:
    """The source's stored K/V and everything needed to rebuild a reader's K/V from it.

    Parameters
    ----------
    model, plan, group, parts
        As for :class:`SharedKVCache`.
    fmt
        FP4 format of the store, or ``None`` (model dtype).
    geo
        The model's geometry: a sliding-window reader gets only the positions its window
        sees; a sliding-window source's store forgets what no reader can see any more.
    rotations
        ``{"k": R, "v": R}`` of a rotated FP4 store (the source layer's,
        :func:`~ced_csa2.kv.rotation.stream_rotations`); empty: unrotated.
    """

    def __init__(self, model: nn.Module, plan: LayerPlan, group: str, parts: CEDParts, fmt, geo: Geometry,
                 rotations: dict[str, HeadRotation]):
        self.model, self.plan, self.group, self.parts, self.geo = model, plan, group, parts, geo
        self.k, self.v = TokenStore(fmt, rotations.get("k")), TokenStore(fmt, rotations.get("v"))
        self.seen = 0  # positions written so far; the store holds the last len(self.k) of them
        # (B,) left padding per row (row_offsets): a row's token at cache position t has RoPE position t - pad
        self.pads: torch.Tensor | None = None
        self.attn = {layer: attention(model, layer) for layer in (plan.source, *plan.targets)}
        self.rope = rope_fn(self.attn[plan.source])
        self.captured: dict | None = None  # kv_hooks.capture's dict while SharedKVCache.feed() is open
        self.sink = GROUPS[group].sink
        # target -> its own (K, V) at each row's first min(seen, sink) positions, (B, n_kv, ·, head_dim) each
        # (keep_sink)
        self.sinks: dict[int, KV] = {}
        # Per forward, shared by the source and every target and dropped after the last target has
        # read: what the readers read of the store (dequantised) and its (cos, sin) per layer type,
        # each built by the first reader that needs it (_entries).
        self._step: dict | None = None

    @property
    def used_bytes(self) -> int:
        """Bytes of the K and V entries written."""
        return self.k.used_bytes + self.v.used_bytes

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors holding the store's per-token entries (reserve included)."""
        return (*self.k.tensors(), *self.v.tensors())

    def write(self, new: int, update_kwargs: dict) -> None:
        """Append the source's captured ``k_proj``/``v_proj`` outputs ``(B, new, kv_dim)``."""
        if self.captured is None:
            raise RuntimeError("SharedKVCache has nothing to store: run the model inside `with cache.feed():` "
                               "(shared_kv_generate does), so the source layer's K/V are captured")
        src = self.plan.source
        k, v = self.captured["k"].pop(src, None), self.captured["v"].pop(src, None)
        if k is None or k.shape[1] != new:
            raise RuntimeError(f"no captured K/V of source layer {src} for the {new} new positions of this forward")
        if self.seen == 0:
            self.pads = torch.zeros(k.shape[0], dtype=torch.long, device=k.device)
        self.pads = row_offsets(update_kwargs, self.seen, new, self.pads)
        self.k.append(k)
        self.v.append(v)
        self.seen += new
        self._step = None

    def read(self, layer: int, new: int) -> KV:
        """K and V of ``layer`` (source or target) for the positions it attends, ``(B, n_kv, T', head_dim)`` each.

        ``T'`` is every position written, or for a sliding-window layer the last
        ``min(seen - new, window - 1) + new`` of them (what ``DynamicSlidingWindowLayer`` returns).
        """
        if self._step is None:
            self._step = {}
        out = self._rebuilt(layer, *self._entries(layer, new, self._step))
        if layer in self.sinks:
            out = self._with_sink(self.sinks[layer], *out)
        if layer == max(self.plan.targets):
            self._step = None  # a transient: not kept between decode steps
            source_window = self.geo.window(self.plan.source)
            if source_window is not None:  # no reader's window reaches further back (plan validation)
                self.k.keep_last(source_window - 1)
                self.v.keep_last(source_window - 1)
        return out

    def keep_sink(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep target ``layer``'s own K and V of this forward, ``(B, n_kv, new, head_dim)`` each, at each row's first
        ``sink`` positions (after :meth:`write`: ``seen`` and ``pads`` count this forward).

        Slot ``j`` of row ``b`` is cache position ``pads[b] + j``; the table holds ``min(seen, sink)`` slots for
        every row, a padded row's later ones filled when its tokens come (until then never served).
        """
        new, slots = k.shape[2], min(self.seen, self.sink)
        at = self.pads[:, None] + torch.arange(slots, device=k.device)[None] - (self.seen - new)  # (B, slots)
        fresh = ((at >= 0) & (at < new))[:, None, :, None]
        if not fresh.any():
            return
        index = at.clamp(0, new - 1)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        kept = self.sinks.get(layer)
        taken = []
        for i, x in enumerate((k, v)):
            x = x.gather(2, index)
            if kept is not None:  # slots past the old table's are all fresh: a row's slot j comes at position >= j
                x = torch.where(fresh, x, torch.cat([kept[i], x[:, :, kept[i].shape[2]:]], dim=2))
            taken.append(x)
        self.sinks[layer] = tuple(taken)

    def _with_sink(self, kept: KV, k: torch.Tensor, v: torch.Tensor) -> KV:
        """``k``, ``v`` ``(B, n_kv, T', head_dim)`` (the last ``T'`` cache positions) with the kept entries ``kept``
        (:meth:`keep_sink`) at each row's first positions."""
        slots = kept[0].shape[2]
        # (B, T') each position's index among its row's tokens: a slot where below `slots`, a pad where negative
        at = torch.arange(self.seen - k.shape[2], self.seen, device=k.device)[None] - self.pads[:, None]
        served = ((at >= 0) & (at < slots))[:, None, :, None]
        if not served.any():  # a sliding window past the first positions
            return k, v
        index = at.clamp(0, slots - 1)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        return tuple(torch.where(served, s.gather(2, index), x) for s, x in zip(kept, (k, v)))

    def _rebuilt(self, layer: int, k: torch.Tensor, v: torch.Tensor, cos, sin) -> KV:
        """``layer``'s K and V as its attention reads them, ``(B, n_kv, T', head_dim)`` each, from the stored
        entries ``(B, T', kv_dim)`` at the positions of ``cos``/``sin``: a target's adapter, then k_norm and RoPE."""
        if layer != self.plan.source and GROUPS[self.group].adapters:
            k, v = self.parts.adapt(layer, k, v)
        return self._norm_rope(self.attn[layer], k, v, cos, sin)

    def _entries(self, layer: int, new: int, step: dict):
        """The stored K and V ``(B, T', kv_dim)`` ``layer`` reads and their RoPE ``cos``/``sin`` ``(B, T', rot)``."""
        if "k" not in step:
            k = self.k.read()
            step.update(k=k, v=self.v.read(), rope=self._rope_per_type(k, self._positions(k)))
        window = self.geo.window(layer)
        visible = step["k"].shape[1] if window is None else min(step["k"].shape[1], window - 1 + new)
        cos, sin = (x[:, -visible:] for x in step["rope"](layer))
        return step["k"][:, -visible:], step["v"][:, -visible:], cos, sin

    def _positions(self, stored: torch.Tensor) -> torch.Tensor:
        """RoPE positions ``(1 | B, T)`` of the ``T`` entries held, ``stored`` ``(B, T, ·)`` (the last ``T`` written)."""
        at = torch.arange(self.seen - stored.shape[1], self.seen, device=stored.device)[None]
        if bool(self.pads.any()):  # a pad's position is masked: any value will do, 0 keeps RoPE's table small
            at = (at - self.pads[:, None]).clamp(min=0)
        return at

    def _rope_per_type(self, k: torch.Tensor, positions: torch.Tensor):
        """``layer -> (cos, sin)`` at ``positions`` ``(B, T)``: one pair per layer type (its own theta, as
        Gemma-3's), computed when a layer of that type first asks."""
        done: dict = {}

        def rope(layer: int):
            kind = layer_type(self.model.config, layer)
            if kind not in done:
                done[kind] = rotary(self.model, layer, k, positions)
            return done[kind]
        return rope

    def _norm_rope(self, attn: nn.Module, k: torch.Tensor, v: torch.Tensor, cos, sin) -> KV:
        """The layer's own k_norm (if any) and RoPE on pre-norm K ``(B, T, kv_dim)``; V reshaped."""
        k = k.view(*k.shape[:2], -1, attn.head_dim)
        if hasattr(attn, "k_norm"):
            k = attn.k_norm(k)
        k = k.transpose(1, 2)
        # apply_rotary_pos_emb rotates a query too; one head keeps that cost negligible (all rows: the
        # positions, so cos/sin, may differ per row -- the sparse decode's selections do).
        _, k = self.rope(k[:, :1], k, cos, sin)
        return k, _heads(v, attn.head_dim)

    def clear(self) -> None:
        self.k.clear()
        self.v.clear()
        self.seen = 0
        self.pads = None
        self.sinks.clear()
        self._step = None


class SharedLayer(_Windowed, _ReadOnlyShape, DynamicLayer):
    """Cache layer of the source or a target: holds nothing itself, reads the shared store."""

    def __init__(self, store: SharedStore, layer: int):
        super().__init__()
        self.store, self.layer, self.window = store, layer, store.geo.window(layer)

    @property
    def seen(self) -> int:
        return self.store.seen

    # The store is counted once, with the source; a target holds its kept sink entries, if any.
    @property
    def used_bytes(self) -> int:
        if self.layer == self.store.plan.source:
            return self.store.used_bytes
        return sum(t.nbytes for t in self.store.sinks.get(self.layer, ()))  # exactly the entries: nothing reserved

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.store.tensors() if self.layer == self.store.plan.source else self.store.sinks.get(self.layer, ())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> KV:
        # key_states/value_states (post-norm, post-RoPE) are not kept -- the store is the only copy -- but a sink
        # group's targets keep theirs at the first positions.
        new = key_states.shape[-2]
        if self.layer == self.store.plan.source:
            self.store.write(new, kwargs)
        elif self.store.sink:
            self.store.keep_sink(self.layer, key_states, value_states)
        self.is_initialized = True
        return self.store.read(self.layer, new)

    def reset(self) -> None:
        self.store.clear()


# ----------------------------------------------------------------------------- caches

@dataclass(frozen=True)
class CacheBytes:
    """The per-token K/V bytes of a cache, used and allocated (:func:`cache_bytes`).

    Attributes
    ----------
    used : int
        Bytes of the entries written: ``keys``/``values`` of the ordinary layers as attention
        sees them, the shared store's and FP4 layers' entries, a sparse store's indexer keys and
        kept entries.  What the per-token accounting (:mod:`ced_csa2.kv.kv_bytes`, the
        ``storage`` stage; :func:`accounted_copies`) predicts, to the byte.
    allocated : int
        Bytes the tensors holding those entries occupy, each distinct storage once
        (:func:`storage_bytes`): the bytes the cache *holds*.  ``>= used``: a
        :class:`TokenStore`'s reserve (fewer than ``TokenStore.GROW`` positions per buffer), and a
        ``DynamicSlidingWindowLayer``'s ``keys``/``values``, views of the last step's
        ``window - 1 + new`` positions.
    """

    used: int
    allocated: int


def cache_bytes(cache: Cache) -> CacheBytes:
    """A cache's per-token K/V bytes, used and allocated: ordinary layers' ``keys``/``values``, FP4 layers and
    the shared store (with a sparse store's indexer keys and kept entries).

    Linear-attention (GatedDeltaNet) states are not counted: their size does not grow
    with the context, and the KV accounting (:mod:`ced_csa2.kv.kv_bytes`) leaves them out too.
    Neither are a cache's working buffers that are not entries (a sparse store's slot table
    and its indexer's decode table and scan buffers: a constant of the cache, not per token).

    Parameters
    ----------
    cache
        A ``DynamicCache``, :class:`SharedKVCache` (sparse too) or :class:`FP4KVCache`.

    Returns
    -------
    CacheBytes
        ``used``: the entries; ``allocated``: the storages of the tensors holding them, each once.

    Examples
    --------
    >>> b = cache_bytes(cache)                          # doctest: +SKIP
    >>> b.used, b.allocated                             # doctest: +SKIP
    """
    used, tensors = 0, []
    for layer in cache.layers:
        if isinstance(layer, (BlockLayer, SharedLayer)):
            used += layer.used_bytes
            tensors += layer.tensors()
        elif isinstance(layer, DynamicLayer) and layer.is_initialized:
            used += layer.keys.nbytes + layer.values.nbytes
            tensors += (layer.keys, layer.values)
    return CacheBytes(used, storage_bytes(tensors))


class SharedKVCache(DynamicCache):
    """``DynamicCache`` in which the plan's source stores its pre-norm K/V once and the targets nothing.

    Parameters
    ----------
    model
        The HF causal LM the cache is used with (its RoPE, k_norms and config are read).
    plan
        The layer plan (validated here against the model's geometry).
    group
        One of :data:`SHARED_GROUPS` (``share_plain``, ``csa2``, ``ced_csa2``, ``ced_csa2_sink``).
    parts
        Trained maps: ``adapters`` for ``*csa2``, ``projector`` for ``ced_csa2``.
    storage
        :data:`STORAGES`: ``"bf16"`` (the model's dtype, plain tensors), ``"nvfp4"`` or
        ``"mxfp4"`` (packed E2M1 blocks, :mod:`ced_csa2.kv.fp4`).
    rotate
        Store the FP4 entries rotated (``csa2_fp4_rot``, ``ced_csa2_fp4_rot`` with ``group`` their
        dense twin): ``FP4(R x)`` per head, ``R`` the source layer's, read as ``Rᵀ dequant(.)`` --
        what Mode B's rotated groups round.  FP4 storage only.

    Examples
    --------
    >>> cache = SharedKVCache(model, plan, "csa2", parts, storage="nvfp4")   # doctest: +SKIP
    >>> with cache.feed():                                                   # doctest: +SKIP
    ...     model(input_ids=ids, cache=cache, use_cache=True)
    >>> cache_bytes(cache).allocated                                         # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, plan: LayerPlan, group: str, parts: CEDParts | None = None,
                 storage: str = "bf16", *, rotate: bool = False):
        if group not in SHARED_GROUPS:
            spec = GROUPS.get(group)
            fp4 = ("; an FP4 group is its dense twin with storage='nvfp4'/'mxfp4' (and rotate=True for a *_fp4_rot "
                   "group): eval.generation.group_cache builds it") if spec and spec.is_fp4 else ""
            raise ValueError(f"group {group!r} has no shared store (SharedKVCache serves {list(SHARED_GROUPS)}); "
                             f"use a DynamicCache for baseline/ced, or FP4KVCache for FP4 without sharing{fp4}")
        parts = parts or CEDParts()
        require_parts(group, parts)
        fmt = _format(storage)
        _check_rotate(rotate, fmt, storage)
        if fmt is not None and GROUPS[group].sink:  # Mode B keeps them exact: an FP4 store would round the source's
            raise ValueError(f"group {group!r} keeps its first positions' entries exact; storage {storage!r} would "
                             "round the source's: give 'bf16'")
        geo = geometry(model.config)
        plan.validate(geo)
        _check_block_width(fmt, geo.kv_dim)
        super().__init__(config=model.config)
        self.plan, self.group, self.storage, self.rotate = plan, group, storage, rotate
        rotations = stream_rotations(geo.head_dim, plan.source) if rotate else {}
        self._store = self._make_store(model, plan, group, parts, fmt, geo, rotations)
        self._projection: CEDModeBRuntime | None = None  # the projector's runtime while feed() is open
        for layer in (plan.source, *plan.targets):
            self.layers[layer - 1] = SharedLayer(self._store, layer)

    def seed(self, *, h_split: torch.Tensor | None = None, source_kv: KV | None = None) -> None:
        """Hand the hooks feed() installed what they would have captured in layers a forward skips (a prefill that
        starts above the split from a plain trunk's hidden state, :class:`ced_csa2.eval.generation.PromptTrunk`):
        ``H_split`` ``(B, T, hidden)`` for the projector of a ``ced_csa2*`` store (as
        :meth:`CEDModeBRuntime.seed <ced_csa2.ced_runtime.CEDModeBRuntime.seed>`; the source's K/V are captured
        at the source itself).  Call inside ``feed()``; a no-op without the projector."""
        if self._projection is not None:
            self._projection.seed(h_split=h_split, source_kv=source_kv)

    def _make_store(self, model, plan, group, parts, fmt, geo, rotations) -> SharedStore:
        return SharedStore(model, plan, group, parts, fmt, geo, rotations)

    @contextmanager
    def feed(self) -> Iterator[SharedKVCache]:
        """Install the hooks that feed the store (and, for ``ced_csa2*``, the CED projection, its first positions
        the source's own under a sink group); always removed."""
        store = self._store
        with ExitStack() as stack:
            if GROUPS[self.group].projected_source:
                # Entered first, so the capture hook below sees the projected K/V.
                self._projection = stack.enter_context(
                    CEDModeBRuntime(store.model, self.plan, "ced", store.parts, kv_format=None))
                stack.callback(setattr, self, "_projection", None)
                if store.sink:  # after the projection, as in Mode B: the first positions store the source's own
                    stack.enter_context(kv_hooks.keep_initial(store.model, [self.plan.source], store.sink))
            store.captured = stack.enter_context(kv_hooks.capture(store.model, [self.plan.source]))
            stack.callback(setattr, store, "captured", None)
            yield self


class BlockKVCache(DynamicCache):
    """``DynamicCache`` with every attention layer's K and V each stored in its own block format.

    ``baseline_k6v4_rot``'s cache (``formats_every_layer``; :func:`~ced_csa2.kv.formats.group_format`
    of its ``stream_formats``).  Each layer ``l`` holds what a ``DynamicLayer`` holds -- K after
    k_norm and RoPE, V -- each stream packed in its format, as ``fmt(R_l x)`` per head where the
    stream rotates (:func:`~ced_csa2.kv.rotation.layer_rotation`) and read as ``Rᵀ dequant(.)``:
    V as Mode B rounds it, K after k_norm and RoPE (Mode B rounds it before them): not Mode B's
    rounding of K, as :class:`FP4KVCache`.

    Parameters
    ----------
    config
        The model's config.
    formats
        K's and V's formats; channel-axis blocks without exact channels (what a cache stores per token).
    """

    def __init__(self, config, formats: KVFormat):
        streams = {"k": formats.k, "v": formats.v}
        bad = [kind for kind, s in streams.items() if s.axis != "channels" or s.exact]
        if bad:  # token-axis blocks need a residual of unfilled blocks; exact channels a split store: neither built
            raise ValueError(f"BlockKVCache stores channel-axis blocks without exact channels; stream(s) {bad} of "
                             f"{formats} are not")
        blocks = {kind: FORMATS[s.element](s.group) for kind, s in streams.items()}
        geo = geometry(config)
        for fmt in blocks.values():
            _check_block_width(fmt, geo.kv_dim)
        super().__init__(config=config)
        self.formats = formats
        # Every attention layer's cache (linear-attention states are not K/V): full ones, and
        # sliding-window ones keeping their window; layers[i] is layer i + 1 (its rotation's seed).
        self.layers = [BlockLayer(blocks["k"], blocks["v"],
                                  layer.sliding_window if type(layer) is DynamicSlidingWindowLayer else None,
                                  {kind: layer_rotation(geo.head_dim, i + 1) for kind, s in streams.items() if s.rotate})
                       if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) else layer
                       for i, layer in enumerate(self.layers)]


class FP4KVCache(BlockKVCache):
    """``baseline_fp4``: ``DynamicCache`` with every attention layer's K/V stored in FP4.

    Parameters
    ----------
    config
        The model's config.
    storage
        ``"nvfp4"`` or ``"mxfp4"``.
    rotate
        ``baseline_fp4_rot``'s store: each layer ``l``'s entries stored as ``FP4(R_l x)`` per head
        (:func:`~ced_csa2.kv.rotation.stream_rotations`) and read as ``Rᵀ dequant(.)``.  ``x`` is
        what a ``DynamicLayer`` holds: V is rounded as Mode B's ``baseline_fp4_rot`` rounds it,
        K after k_norm and RoPE (Mode B rounds it before them): not Mode B's rounding of K.
    """

    def __init__(self, config, storage: str = "nvfp4", *, rotate: bool = False):
        fmt = _format(storage)
        if fmt is None:
            raise ValueError(f"FP4KVCache needs an FP4 storage ({list(FP4_FORMATS)}), got {storage!r}")
        # ROTATED_STREAMS read at the call, as stream_rotations reads it (a study may set it).
        super().__init__(config, KVFormat(*(StreamFormat(storage, fmt.group, rotate=rotate and kind in
                                                         kv_rotation.ROTATED_STREAMS) for kind in "kv")))
        self.storage, self.rotate = storage, rotate


# ----------------------------------------------------------------------------- accounting

def accounted_copies(geo: Geometry, plan: LayerPlan, group: str, storage: str, dtype_bytes: int,
                     rank: int | None = None) -> list[StoredCopy]:
    """What a cache should hold per token on the ``all_attention`` basis (:mod:`ced_csa2.kv.kv_bytes`).

    ``group`` ``baseline`` with an FP4 ``storage`` is :class:`FP4KVCache` (every layer in
    FP4); a shared group with an FP4 ``storage`` stores only the source in FP4.  ``xkv``
    (dense storage only) holds ``rank`` coefficients (default ``kv_dim``) for K and for V
    per token in place of the source's and targets' entries.  An FP4 group (``*_fp4``,
    ``*_fp4_rot``) needs its ``kv_format`` as ``storage`` and holds its own FP4 entries
    (:meth:`~ced_csa2.groups.Group.fp4_layers`); a rotation adds no per-token bytes.  A group
    with its own ``stream_formats`` (:class:`BlockKVCache`) holds them whatever the storage: give ``"bf16"``.
    A sink group's targets hold their kept entries in the model's dtype (:func:`~ced_csa2.kv.kv_bytes.sink_copies`).
    """
    fmt = _format(storage)
    spec = group_spec(group)  # refuses an unknown group
    copies = kv_copies(geo, plan, spec, "all_attention", dtype_bytes, rank=rank)
    kept = sink_copies(geo, plan, spec, "all_attention", dtype_bytes)  # dense whatever the storage
    if spec.stream_formats is not None and fmt is not None:
        raise ValueError(f"group {group!r} fixes its own stream_formats; FP4 storage {storage!r} does not apply "
                         "(give 'bf16')")
    if spec.is_fp4 and fmt is None:
        raise ValueError(f"group {group!r} stores FP4 entries: give its kv_format as storage ({list(FP4_FORMATS)}), "
                         f"got {storage!r}")
    if fmt is None:
        return copies + kept
    if spec.low_rank:
        raise ValueError(f"group {group!r} stores dense cross-layer coefficients; FP4 storage {storage!r} is not defined")
    fp4 = fmt.entry_bytes(geo.kv_dim)
    if spec.is_fp4:  # the group's own FP4 entries (its rotation, if any, is weights: no bytes per token)
        fp4_names = {f"{kind}{layer}" for layer in spec.fp4_layers(geo.attention_layers, plan.source) for kind in "KV"}
    else:
        fp4_names = {f"{kind}{plan.source}" for kind in "KV"} if group in SHARED_GROUPS else {c.name for c in copies}
    return [dataclasses.replace(c, entry_bytes=fp4) if c.name in fp4_names else c for c in copies] + kept


# ----------------------------------------------------------------------------- generation

@dataclass
class Generation:
    """Result of :func:`greedy_generate`.

    Attributes
    ----------
    tokens : torch.Tensor, shape (B, N)
        The generated tokens.
    logits : torch.Tensor, shape (B, N, vocab)
        The logits that chose them (step ``i`` predicts ``tokens[:, i]``).
    cache : Cache
        The cache after the last step: ``prompt + N - 1`` positions.
    """

    tokens: torch.Tensor
    logits: torch.Tensor
    cache: Cache


@torch.inference_mode()
def greedy_generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, cache: Cache) -> Generation:
    """Greedy decoding with a given cache: prefill ``input_ids`` ``(B, T)`` (no padding), then one token per step."""
    x, tokens, logits = input_ids, [], []
    for _ in range(max_new_tokens):
        # logits_to_keep=1: a long prefill never builds (T, vocab) logits.
        step = model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        x = step.argmax(-1, keepdim=True)
        tokens.append(x)
        logits.append(step)
    return Generation(torch.cat(tokens, dim=1), torch.stack(logits, dim=1), cache)


def shared_kv_generate(model: nn.Module, plan: LayerPlan, group: str, parts: CEDParts | None,
                       input_ids: torch.Tensor, max_new_tokens: int, storage: str = "bf16") -> Generation:
    """Greedy decoding of ``input_ids`` ``(B, T)`` with a :class:`SharedKVCache`; hooks always removed.

    Returns
    -------
    Generation
        Its ``cache`` is the :class:`SharedKVCache` (its bytes: :func:`cache_bytes`).
    """
    cache = SharedKVCache(model, plan, group, parts, storage)
    with cache.feed():
        return greedy_generate(model, input_ids, max_new_tokens, cache)
