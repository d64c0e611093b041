"""CSA2 decode that pays for its adapters: each reader reads the local window and a top-k selection.

:class:`~ced_csa2.runtime.shared_kv.SharedKVCache` rebuilds every target's K/V for *all*
cached positions at each decode step -- the adapters, k_norm and RoPE over ``T``
positions, a cost that grows with the context.  DeepSeek-V4.1's *Reuse* mode (seed 003
§4.3) lets a layer attend only over the entries its index source selected plus a local
window; a CSA2 target then needs adapted K/V for those entries only.
:class:`SparseSharedKVCache` is that decode path.  At each decode step the plan's source
selects the ``k`` best positions older than the ``window``, and every target (Reuse of the
source's selection) gathers the stored entries at those positions and at the newest
``window``, runs its adapter, k_norm and RoPE on them only, and attends over them.  Who
selects, and what the source itself reads, depends on the indexer:

* **oracle** (no ``indexer``): the source attends densely over its store and ranks by its
  own attention logits summed over its heads
  (:func:`~ced_csa2.runtime.sparse_attention.index_scores`) -- an upper bound on what a
  trained indexer picks, and it needs the source's post-RoPE keys for every position, so
  the source still rebuilds them each step;
* **trained** (a :class:`~ced_csa2.maps.indexer.LightningIndexer` of the source layer): the
  store also keeps one indexer key per position (MXFP4, counted in :attr:`_SparseStore.used_bytes`),
  the indexer scores them against queries from the source's attention input, and the source
  too reads only its selection and window (V4.1's Full mode): no reader touches every
  position's K/V, only the indexer's keys are scanned.

Prefill (more than one new position) is the dense store's (the indexer keys of the prompt
are written then).  While ``k + window`` covers the context the step is the dense one, bit
for bit.  A target keeps its entries of the last step as its attention read them (adapted,
normed, rotated) and runs its adapter, k_norm and RoPE only on the positions the step newly
reads (the window moves by one; on the embedded default about
half of the top-128 changes between steps).  The bytes used are the dense store's plus the
indexer keys plus those ``k + window`` adapted entries per target
(:meth:`SparseDecode.adapted_bytes`, flat in the context); the bytes allocated add the
indexer keys' reserve, as the store's (:class:`~ced_csa2.runtime.shared_kv.TokenStore`,
:func:`~ced_csa2.runtime.shared_kv.cache_bytes`).

Limits: the dense store's (unpadded batches, no beam search), and no sliding-window source
or target (SmolLM2 and Qwen3.5-4B have none in their plans).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from ..kv.block_format import Packed
from ..kv.fp4 import e2m1_decode, e8m0_scale_values, unpack_nibbles
from ..maps.indexer import LightningIndexer, key_format
from ..model_utils import attention, rotary
from .attention_calls import AttentionCalls
from ..groups import GROUPS
from .shared_kv import KV, SharedKVCache, TokenStore, SharedStore
from .sparse_attention import index_scores


@dataclass(frozen=True)
class SparseDecode:
    """What a target reads at a decode step: the source's ``k`` best older entries and the newest ``window``.

    ``keep``: how many entries each target keeps between steps as its attention read them
    (adapted, normed, rotated), the most recently read first (:meth:`_SparseStore._rebuilt`);
    at least ``k + window`` (the default: the last step's), a constant, so the bytes stay
    flat in the context.  More keeps more of the entries a selection drops and takes back a
    few steps later, which then skip the adapter.
    """

    k: int
    window: int
    keep: int | None = None

    def __post_init__(self):
        if self.k < 0 or self.window < 1:
            raise ValueError(f"sparse decode reads k >= 0 selected entries and a window >= 1 (the new position "
                             f"itself); got k={self.k}, window={self.window}")
        if self.keep is not None and self.keep < self.k + self.window:
            raise ValueError(f"sparse decode keeps at least the k + window = {self.k + self.window} entries a step "
                             f"reads; got keep={self.keep}")

    @classmethod
    def from_spec(cls, spec: str) -> SparseDecode:
        """The reads ``K:WINDOW[:KEEP]`` names (a benchmark's ``--sparse``), e.g. ``128:64``."""
        parts = spec.split(":")
        if len(parts) not in (2, 3) or not all(part.isdigit() for part in parts):
            raise ValueError(f"sparse decode reads {spec!r}: expected K:WINDOW[:KEEP] in whole numbers, e.g. 128:64")
        return cls(*map(int, parts))

    @property
    def kept(self) -> int:
        """Entries per target kept between steps: ``keep``, or ``k + window``."""
        return self.k + self.window if self.keep is None else self.keep

    def adapted_bytes(self, targets: int, kv_dim: int, dtype_bytes: int, batch: int = 1) -> int:
        """Bytes of the targets' K and V kept between steps (:meth:`_SparseStore._rebuilt`): :attr:`kept`
        entries per target, flat in the context."""
        return batch * targets * self.kept * 2 * kv_dim * dtype_bytes


def select(scores: torch.Tensor, n: int, reads: SparseDecode) -> torch.Tensor:
    """Positions a reader reads at one decode step, ``(B, k + window)`` ascending.

    ``scores`` ``(B, n - window)`` rank the positions before the window (``n`` cached
    positions, the new one included); the ``k`` best, then the window's ``n - window .. n - 1``.
    """
    top = scores.topk(reads.k, dim=-1).indices.sort(dim=-1).values
    recent = torch.arange(n - reads.window, n, device=scores.device).expand(scores.shape[0], -1)
    return torch.cat([top, recent], dim=-1)


class KeyScan:
    """The indexer keys of an MXFP4 store decoded for a scan: :meth:`MXFP4.dequantize`, bit for bit, in one lookup per byte.

    The format's own decode looks up each element byte's two values, then multiplies them by
    their block's scale in a second pass.  Here one table holds that product for every
    (scale byte, element byte) pair -- 256 × 256 pairs of float32, 512 KiB, built once per
    store by the same float32 multiply -- so a byte and its block's scale give both channels
    in one gather.  Scale byte 255 (NaN in E8M0, never written) decodes to NaN.

    :meth:`scores` decodes :attr:`BLOCK` positions at a time into buffers it keeps: the trained
    indexer scans every older key at every decode step, and a fresh buffer for all of them
    (6 MiB at 8,192 keys of 192 channels) costs more in page faults than the decode itself
    (``benchmarks/indexer_scan.py``, docs/results.md).
    """

    BLOCK = 2048  # positions per decoded block: 1.5 MiB of float32 keys at 192 channels, reused

    def __init__(self, device: torch.device | None = None):
        pairs = e2m1_decode(unpack_nibbles(torch.arange(256, dtype=torch.uint8))).view(256, 2)  # byte -> (low, high)
        scales = torch.cat((e8m0_scale_values(torch.arange(255, dtype=torch.uint8)), torch.tensor([torch.nan])))
        # (scale << 8 | byte) -> the byte's two channels, as one int64 per pair so that a gather moves both
        self.table = (scales[:, None, None] * pairs).view(torch.int64).reshape(-1).to(device)
        self._index = self._pairs = torch.empty(0, dtype=torch.int64, device=device)  # scores' reused buffers

    def _decode(self, packed: Packed, start: int, end: int, reuse: bool) -> torch.Tensor:
        """Entries ``start .. end - 1`` of ``packed`` ``(B, T, D)``, float32 ``(B, end - start, D)``; with ``reuse``
        a view of this scan's buffers, overwritten by the next call."""
        if packed.scale_kind != "e8m0":
            raise ValueError(f"KeyScan decodes MXFP4 (E8M0 scales), got {packed.scale_kind} scales")
        b, _, d = packed.shape
        g, m = packed.group, end - start
        shape, size = (b, m, d // g, g // 2), b * m * d // 2
        index = pairs = None
        if reuse:
            if self._pairs.numel() < size:
                self._index = torch.empty(b * self.BLOCK * d // 2, dtype=torch.int32, device=self.table.device)
                self._pairs = torch.empty(b * self.BLOCK * d // 2, dtype=torch.int64, device=self.table.device)
            index, pairs = self._index[:size].view(shape), self._pairs[:size]
        scale_bytes = packed.scales[:, start:end].to(torch.int32) << 8
        # int32: the gather's cheaper index type
        index = torch.add(scale_bytes.unsqueeze(-1), packed.elements[:, start:end].reshape(shape), out=index)
        return torch.index_select(self.table, 0, index.reshape(-1), out=pairs).view(torch.float32).view(b, m, d)

    def __call__(self, packed: Packed, n: int) -> torch.Tensor:
        """The first ``n`` entries of ``packed`` ``(B, T, D)`` (E8M0 scales), float32 ``(B, n, D)``."""
        return self._decode(packed, 0, n, reuse=False)

    def scores(self, packed: Packed, n: int, score: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``score`` of the first ``n`` entries of ``packed``, ``(B, n)`` float32, decoded :attr:`BLOCK` at a time.

        ``score`` maps decoded keys ``(B, m, D)`` (a view of a reused buffer) to ``(B, m)``.
        """
        out = torch.empty(packed.shape[0], n, device=self.table.device)
        for start in range(0, n, self.BLOCK):
            end = min(start + self.BLOCK, n)
            out[:, start:end] = score(self._decode(packed, start, end, reuse=True))
        return out


@dataclass(frozen=True)
class _Slots:
    """Where the entries of one step's read sit in a :class:`KeptEntries` table.

    ``slot`` ``(B, m)``: the slot of each read position kept (0 where missed); ``miss``
    ``(B, m)`` bool; ``missed`` ``(misses,)``: the missed entries' flat indices into ``(B·m)``,
    row-major; ``free``: ``(rows, slots)``, each ``(misses,)``, where those are kept from now on.
    """

    slot: torch.Tensor
    miss: torch.Tensor
    missed: torch.Tensor
    free: tuple[torch.Tensor, torch.Tensor]


class KeptEntries:
    """The entries the targets read at recent steps, as each target's attention read them: one slot table for all.

    Every target reads the same positions at a step, so which positions are kept, and in which
    slot, is the same for all of them: :meth:`place` does that bookkeeping once per step, and
    each target's :meth:`read` only gathers its own entries and rebuilds the missed ones.
    ``positions`` ``(B, n)`` (-1: an empty slot) and ``last_read`` ``(B, n)`` (the step that last
    read each, as a count of cached positions; -1: never); per target ``k``/``v``
    ``(B, n_kv, n, head_dim)``.
    """

    def __init__(self, batch: int, n: int, device: torch.device):
        self.positions = torch.full((batch, n), -1, dtype=torch.long, device=device)
        self.last_read = self.positions.clone()
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    @property
    def used_bytes(self) -> int:
        """Bytes of the targets' kept K and V (every slot: the tables are allocated whole at a target's first read)."""
        return sum(x.nbytes for x in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The targets' K and V tables (the slot bookkeeping, ``positions`` and ``last_read``, is not entries)."""
        return (*self.k.values(), *self.v.values())

    def place(self, at: torch.Tensor, step: int) -> _Slots:
        """The slots of positions ``at`` ``(B, m)`` read at ``step``; the missed ones take the longest unread slots
        (never one read now), whose entries every target then replaces in its :meth:`read`."""
        found = at[:, :, None] == self.positions[:, None, :]  # (B, m, n): at most one slot per position
        miss, slot = ~found.any(-1), found.to(torch.uint8).argmax(-1)
        self.last_read.masked_fill_(found.any(1), step)
        rows, slots = [], []
        for b, m in enumerate(miss.sum(-1).tolist()):
            if m:
                free = self.last_read[b].topk(m, largest=False).indices
                self.positions[b, free], self.last_read[b, free] = at[b, miss[b]], step
                rows.append(torch.full_like(free, b))
                slots.append(free)
        free = (torch.cat(rows), torch.cat(slots)) if rows else (slot.new_empty(0),) * 2
        return _Slots(slot, miss, miss.flatten().nonzero().squeeze(1), free)

    def read(self, layer: int, slots: _Slots, attn, like: torch.Tensor, rebuild) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s K and V ``(B, n_kv, m, head_dim)`` at the positions :meth:`place` gave ``slots`` for; the
        missed ones from ``rebuild(slots.missed)`` (``(1, n_kv, misses, head_dim)`` each, in row order), which
        are kept in their free slots.  ``attn`` (its ``head_dim``) and the stored entries ``like``
        ``(B, m, kv_dim)`` shape a target's table at its first read."""
        if layer not in self.k:
            b, n = self.positions.shape
            self.k[layer] = like.new_zeros((b, like.shape[-1] // attn.head_dim, n, attn.head_dim))
            self.v[layer] = self.k[layer].clone()
        k, v = self.k[layer], self.v[layer]
        index = slots.slot[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
        k_out, v_out = k.gather(2, index), v.gather(2, index)
        if slots.missed.numel():  # one call over every row's new positions (an adapter, k_norm and RoPE map rows alone)
            new_k, new_v = rebuild(slots.missed)
            new_k, new_v = new_k[0].transpose(0, 1), new_v[0].transpose(0, 1)  # (misses, n_kv, head_dim)
            k_out.transpose(1, 2)[slots.miss] = new_k
            v_out.transpose(1, 2)[slots.miss] = new_v
            k.transpose(1, 2)[slots.free] = new_k
            v.transpose(1, 2)[slots.free] = new_v
        return k_out, v_out


class _SparseStore(SharedStore):
    """The shared store, read at the selected positions only at a sparse decode step; with an indexer, its keys too."""

    def __init__(self, *args, reads: SparseDecode, indexer: LightningIndexer | None):
        super().__init__(*args)
        self.reads, self.indexer = reads, indexer
        self.index_keys = TokenStore(key_format(indexer.key_width)) if indexer is not None else None
        self.scan = KeyScan(next(indexer.parameters()).device) if indexer is not None else None
        self.x: torch.Tensor | None = None  # the source's attention input of this forward (the indexer's queries)
        # (B, k + window) positions of this forward's sparse step: set by the source (its indexer, or the
        # oracle at its attention call); None: every reader reads every position.
        self.selection: torch.Tensor | None = None
        # the entries the targets read at recent sparse steps, adapted, normed and rotated (_rebuilt); None
        # until the first sparse step, and again after a dense one
        self.adapted: KeptEntries | None = None

    @property
    def used_bytes(self) -> int:
        """The dense store's bytes, plus the indexer keys and the entries the targets keep between steps."""
        return super().used_bytes + sum(x.used_bytes for x in self._extras())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The dense store's tensors, plus the indexer keys' buffers (reserve included) and the targets' kept K/V."""
        return (*super().tensors(), *(t for x in self._extras() for t in x.tensors()))

    def _extras(self) -> list:
        """What this store keeps beyond the dense store's entries: the indexer keys, the targets' kept entries."""
        return [x for x in (self.index_keys, self.adapted) if x is not None]

    def covered(self) -> bool:
        """Whether ``k + window`` reaches every cached position (the step is then the dense one)."""
        return self.reads.k + self.reads.window >= self.seen

    def write(self, new: int, update_kwargs: dict) -> None:
        if self.indexer is not None and self.captured is not None and self.plan.source in self.captured["k"]:
            k = self.captured["k"][self.plan.source]
            positions = torch.arange(self.seen, self.seen + new, device=k.device)[None]
            cos, sin = rotary(self.model, self.plan.source, k, positions)
            with torch.no_grad():
                self.index_keys.append(self.indexer.keys(k, cos, sin))
        super().write(new, update_kwargs)
        if bool(self.pads.any()):  # its selections and indexer keys index cache positions as RoPE positions
            raise ValueError("SparseSharedKVCache takes unpadded batches only; got left padding "
                             f"{self.pads.tolist()} (per row)")

    def _entries(self, layer: int, new: int, step: dict):
        if layer == self.plan.source:
            self.selection = None  # a new forward: the source selects again
            if self.indexer is not None and new == 1 and not self.covered():
                self.selection = self._indexed()
        if self.selection is None:
            return super()._entries(layer, new, step)
        if "selected" not in step:  # every sparse reader of this forward reads the same positions
            at = self.selection
            k = self.k.read(at)
            step["selected"] = k, self.v.read(at), self._rope_per_type(k, at)
        k, v, rope = step["selected"]
        return (k, v, *rope(layer))

    def _rebuilt(self, layer: int, k: torch.Tensor, v: torch.Tensor, cos, sin):
        """A target's K and V at the selected positions, rebuilt only where it does not keep them from earlier steps.

        Consecutive steps read mostly the same positions (the window shifts by one, and the
        top-``k`` changes in part).  What a target's attention reads of an entry (its adapter,
        k_norm and RoPE: :meth:`SharedStore._rebuilt`) depends on that entry and its position
        alone, so an entry it kept is taken from there: only the other positions run the
        adapter, k_norm and RoPE.  Each target keeps ``reads.kept`` entries (counted in
        :attr:`used_bytes`), the most recently read: the new ones replace the longest unread.  The
        targets read the same positions, so one :class:`KeptEntries` table places them for all (at the
        first target of each forward).
        """
        at = self.selection
        if layer == self.plan.source or not GROUPS[self.group].adapters:
            return super()._rebuilt(layer, k, v, cos, sin)
        if at is None:  # a dense step: every position, nothing carried
            self.adapted = None
            return super()._rebuilt(layer, k, v, cos, sin)
        if self.adapted is None:
            self.adapted = KeptEntries(at.shape[0], self.reads.kept, at.device)
        if "slots" not in self._step:  # the first target of this forward places the step's positions for all
            self._step["slots"] = self.adapted.place(at, self.seen)
        slots = self._step["slots"]

        def rebuild(missed: torch.Tensor) -> KV:
            return super(_SparseStore, self)._rebuilt(layer, *(x.flatten(0, 1).index_select(0, missed)[None]
                                                               for x in (k, v, cos, sin)))
        return self.adapted.read(layer, slots, self.attn[layer], k, rebuild)

    @torch.no_grad()
    def _indexed(self) -> torch.Tensor:
        """The trained indexer's selection for the one new position."""
        n, older = self.seen, self.seen - self.reads.window
        at = torch.full((self.x.shape[0], 1), n - 1, device=self.x.device)
        queries, weights = self.indexer.queries(self.x, *rotary(self.model, self.plan.source, self.x, at))
        scores = self.scan.scores(self.index_keys.data, older,
                                  lambda keys: LightningIndexer.scores(queries, weights, keys)[:, 0])
        return select(scores, n, self.reads)

    def clear(self) -> None:
        super().clear()
        self.adapted = None
        if self.index_keys is not None:
            self.index_keys.clear()


class SparseSharedKVCache(SharedKVCache):
    """:class:`~ced_csa2.runtime.shared_kv.SharedKVCache` whose targets read ``reads`` at each decode step.

    Parameters
    ----------
    model, plan, group, parts, storage
        As for :class:`~ced_csa2.runtime.shared_kv.SharedKVCache`.
    reads
        The selected entries and the window of every target read.

    Examples
    --------
    >>> cache = SparseSharedKVCache(model, plan, "csa2", parts, reads=SparseDecode(k=128, window=64))  # doctest: +SKIP
    >>> with cache.feed():                                                                       # doctest: +SKIP
    ...     out = greedy_generate(model, ids, 32, cache)
    """

    def __init__(self, model, plan, group, parts=None, storage: str = "bf16", *, reads: SparseDecode,
                 indexer: LightningIndexer | None = None):
        if group in GROUPS and GROUPS[group].sink:  # its selections index the store, not the targets' kept entries
            raise ValueError(f"SparseSharedKVCache: group {group!r} keeps sink entries, which the sparse reads do "
                             "not serve; decode it through SharedKVCache")
        self.reads, self.indexer = reads, indexer
        super().__init__(model, plan, group, parts, storage)
        geo = self._store.geo
        sliding = [la for la in (plan.source, *plan.targets) if geo.window(la) is not None]
        if sliding:
            raise NotImplementedError(f"sparse decode keeps no sliding windows; layers {sliding} of the plan have one")
        self._calls = AttentionCalls(attention(model, plan.source), "the sparse decode drops the readers' masks")
        self._modules = {attention(model, la): la for la in (plan.source, *plan.targets)}

    def _make_store(self, *args) -> _SparseStore:
        return _SparseStore(*args, reads=self.reads, indexer=self.indexer)

    def _attend(self, original, module, query, key, value, attention_mask, *args, **kwargs):
        layer, store = self._modules.get(module), self._store
        if layer is None:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        if layer == self.plan.source and store.indexer is None and query.shape[2] == 1 and not store.covered():
            # The oracle ranks by the source's own logits: its keys (every position, post-RoPE) are here.
            older = key.shape[2] - self.reads.window
            store.selection = select(index_scores(query, key[:, :, :older])[:, 0], key.shape[2], self.reads)
        elif store.selection is not None:
            attention_mask = None  # one unpadded query sees every entry it was handed
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    @contextmanager
    def feed(self) -> Iterator[SparseSharedKVCache]:
        """The store's hooks, the readers' sparse reads and (with an indexer) its query input; all always removed."""
        store = self._store
        with ExitStack() as stack:
            stack.enter_context(super().feed())
            stack.enter_context(self._calls.routed(self._attend))
            if self.indexer is not None:
                hook = attention(store.model, self.plan.source).k_proj.register_forward_hook(
                    lambda mod, inp, out: setattr(store, "x", inp[0]))
                stack.callback(hook.remove)
                stack.callback(setattr, store, "x", None)
            yield self
