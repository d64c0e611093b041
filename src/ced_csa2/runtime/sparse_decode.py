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
  store also keeps one indexer key per position (MXFP4, counted in :attr:`_SparseStore.nbytes`),
  the indexer scores them against queries from the source's attention input, and the source
  too reads only its selection and window (V4.1's Full mode): no reader touches every
  position's K/V, only the indexer's keys are scanned.

Prefill (more than one new position) is the dense store's (the indexer keys of the prompt
are written then).  While ``k + window`` covers the context the step is the dense one, bit
for bit.  A target keeps its entries of the last step as its attention read them (adapted,
normed, rotated) and runs its adapter, k_norm and RoPE only on the positions the step newly
reads (the window moves by one; on the embedded default about
half of the top-128 changes between steps).  The bytes held are the dense store's plus the
indexer keys plus those ``k + window`` adapted entries per target
(:meth:`SparseDecode.adapted_bytes`, flat in the context).

Limits: the dense store's (unpadded batches, no beam search), and no sliding-window source
or target (SmolLM2 and Qwen3.5-4B have none in their plans).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from ..kv.fp4 import Packed, e2m1_decode, e8m0_scale_values, unpack_nibbles
from ..maps.indexer import LightningIndexer, key_format
from ..model_utils import attention, rotary
from .attention_calls import AttentionCalls
from .groups import GROUPS
from .shared_kv import SharedKVCache, TokenStore, _SharedStore
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
    in one gather.  The trained indexer scans every older key at every decode step; at 8,192
    keys of 192 channels this decode took ~1.5 ms against the format's ~4.0 ms on the
    2-core Xeon (median of 40, alone), the largest part of the scan (docs/results.md).
    Scale byte 255 (NaN in E8M0, never written) decodes to NaN.
    """

    def __init__(self, device: torch.device | None = None):
        pairs = e2m1_decode(unpack_nibbles(torch.arange(256, dtype=torch.uint8))).view(256, 2)  # byte -> (low, high)
        scales = torch.cat((e8m0_scale_values(torch.arange(255, dtype=torch.uint8)), torch.tensor([torch.nan])))
        # (scale << 8 | byte) -> the byte's two channels, as one int64 per pair so that a gather moves both
        self.table = (scales[:, None, None] * pairs).view(torch.int64).reshape(-1).to(device)

    def __call__(self, packed: Packed, n: int) -> torch.Tensor:
        """The first ``n`` entries of ``packed`` ``(B, T, D)`` (E8M0 scales), float32 ``(B, n, D)``."""
        if packed.scale_kind != "e8m0":
            raise ValueError(f"KeyScan decodes MXFP4 (E8M0 scales), got {packed.scale_kind} scales")
        b, _, d = packed.shape
        g = packed.group
        elements = packed.elements[:, :n].reshape(b, n, d // g, g // 2)
        scales = packed.scales[:, :n].to(torch.int32) << 8
        index = (scales.unsqueeze(-1) + elements).reshape(-1)  # int32: the gather's cheaper index type
        return self.table.index_select(0, index).view(torch.float32).view(b, n, d)


@dataclass
class _Kept:
    """``n`` entries of one target as its attention read them at recent steps, per batch row, in no order.

    ``positions`` ``(B, n)`` (-1: an empty slot), ``last_read`` ``(B, n)`` (the step that last
    read each, as a count of cached positions; -1: never), ``k``/``v`` ``(B, n_kv, n, head_dim)``.
    """

    positions: torch.Tensor
    last_read: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def empty(cls, batch: int, n: int, attn, like: torch.Tensor) -> _Kept:
        heads = like.new_zeros((batch, like.shape[-1] // attn.head_dim, n, attn.head_dim))
        slots = torch.full((batch, n), -1, dtype=torch.long, device=like.device)
        return cls(slots, slots.clone(), heads, heads.clone())

    def read(self, at: torch.Tensor, step: int, rebuild) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``(B, n_kv, len(at), head_dim)`` at positions ``at`` ``(B, len(at))``; those not kept from
        ``rebuild(miss)`` (``miss`` ``(B, len(at))`` bool; it returns the missed entries of every row in row
        order, ``(1, n_kv, misses, head_dim)`` each), which then replace the longest unread entries."""
        held = at[:, :, None] == self.positions[:, None, :]  # (B, len(at), n): at most one slot per position
        miss, slot = ~held.any(-1), held.to(torch.uint8).argmax(-1)
        rows = slot[:, None, :, None].expand(-1, self.k.shape[1], -1, self.k.shape[-1])
        k_out, v_out = self.k.gather(2, rows), self.v.gather(2, rows)
        self.last_read.masked_fill_(held.any(1), step)
        if miss.any():  # one call over every row's new positions (an adapter, k_norm and RoPE map rows alone)
            new_k, new_v = rebuild(miss)
            new_k, new_v = new_k[0].transpose(0, 1), new_v[0].transpose(0, 1)  # (misses, n_kv, head_dim)
            k_out.transpose(1, 2)[miss] = new_k
            v_out.transpose(1, 2)[miss] = new_v
            start = 0
            for b, m in enumerate(miss.sum(-1).tolist()):  # the m longest unread slots (never one read now)
                if m:
                    free = self.last_read[b].topk(m, largest=False).indices
                    self.positions[b, free], self.last_read[b, free] = at[b, miss[b]], step
                    self.k[b].transpose(0, 1)[free] = new_k[start:start + m]
                    self.v[b].transpose(0, 1)[free] = new_v[start:start + m]
                    start += m
        return k_out, v_out


class _SparseStore(_SharedStore):
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
        # target -> the entries it read at recent sparse steps, adapted, normed and rotated (_rebuilt)
        self.adapted: dict[int, _Kept] = {}

    @property
    def nbytes(self) -> int:
        """The dense store's bytes, plus the indexer keys and the entries the targets keep between steps."""
        adapted = sum(kept.k.nbytes + kept.v.nbytes for kept in self.adapted.values())
        return super().nbytes + adapted + (self.index_keys.nbytes if self.index_keys is not None else 0)

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
        k_norm and RoPE: :meth:`_SharedStore._rebuilt`) depends on that entry and its position
        alone, so an entry it kept is taken from there: only the other positions run the
        adapter, k_norm and RoPE.  Each target keeps ``reads.kept`` entries (counted in
        :attr:`nbytes`), the most recently read: the new ones replace the longest unread.
        """
        at = self.selection
        if layer == self.plan.source or not GROUPS[self.group].adapters:
            return super()._rebuilt(layer, k, v, cos, sin)
        if at is None:  # a dense step: every position, nothing carried
            self.adapted.clear()
            return super()._rebuilt(layer, k, v, cos, sin)
        kept = self.adapted.get(layer)
        if kept is None:
            kept = self.adapted[layer] = _Kept.empty(at.shape[0], self.reads.kept, self.attn[layer], k)
        return kept.read(at, self.seen, lambda miss: super(_SparseStore, self)._rebuilt(
            layer, *(x[miss][None] for x in (k, v, cos, sin))))

    @torch.no_grad()
    def _indexed(self) -> torch.Tensor:
        """The trained indexer's selection for the one new position."""
        n, older = self.seen, self.seen - self.reads.window
        at = torch.full((self.x.shape[0], 1), n - 1, device=self.x.device)
        queries, weights = self.indexer.queries(self.x, *rotary(self.model, self.plan.source, self.x, at))
        keys = self.scan(self.index_keys.data, older).to(self.index_keys.dtype)
        return select(LightningIndexer.scores(queries, weights, keys)[:, 0], n, self.reads)

    def clear(self) -> None:
        super().clear()
        self.adapted.clear()
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
