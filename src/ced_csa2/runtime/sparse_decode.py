"""CSA2 decode that pays for its adapters: each target reads the local window and the source's top-k.

:class:`~ced_csa2.runtime.shared_kv.SharedKVCache` rebuilds every target's K/V for *all*
cached positions at each decode step -- the adapters, k_norm and RoPE over ``T``
positions, a cost that grows with the context.  DeepSeek-V4.1's *Reuse* mode (seed 003
§4.3) lets a layer attend only over the entries its index source selected plus a local
window; a CSA2 target then needs adapted K/V for those entries only.
:class:`SparseSharedKVCache` is that decode path:

* the **source** attends densely over its store (a Full layer reading everything) and,
  at each decode step, ranks the positions older than the window with the oracle indexer
  (:func:`~ced_csa2.runtime.sparse_attention.index_scores`: its own attention logits summed
  over its heads -- an upper bound on what a trained indexer picks) and keeps the best ``k``;
* each **target** (Reuse of the source's selection) gathers the stored entries at those
  ``k`` positions and at the newest ``window``, runs its adapter, k_norm and RoPE on them
  only, and attends over them: its read is flat in the context;
* the bytes held are the dense store's: nothing else is kept (the window's entries are
  re-adapted at each step rather than cached).

Prefill (more than one new position) is the dense store's.  While ``k + window`` covers the
context the step is the dense one, bit for bit.  The oracle's scores read the source's
full keys (``T · kv_dim`` multiply-adds per step, as its own attention does); a trained
indexer would read narrower keys it stores itself.

Limits: the dense store's (unpadded batches, no beam search), and no sliding-window source
or target (SmolLM2 and Qwen3.5-4B have none in their plans).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..model_utils import attention, rotary
from .attention_calls import AttentionCalls
from .shared_kv import SharedKVCache, _SharedStore
from .sparse_attention import index_scores


@dataclass(frozen=True)
class SparseDecode:
    """What a target reads at a decode step: the source's ``k`` best older entries and the newest ``window``."""

    k: int
    window: int

    def __post_init__(self):
        if self.k < 0 or self.window < 1:
            raise ValueError(f"sparse decode reads k >= 0 selected entries and a window >= 1 (the new position "
                             f"itself); got k={self.k}, window={self.window}")


def select(query: torch.Tensor, key: torch.Tensor, reads: SparseDecode) -> torch.Tensor | None:
    """Positions a target reads at one decode step, ``(B, k + window)`` ascending; ``None`` when that is all of them.

    ``query`` ``(B, H, 1, d)`` and ``key`` ``(B, n_kv, T, d)`` are the source's attention
    inputs (post-RoPE).  The ``k`` best of the positions before the window, by
    :func:`~ced_csa2.runtime.sparse_attention.index_scores`, then the window's ``T - window .. T - 1``.
    """
    n = key.shape[2]
    if reads.k + reads.window >= n:
        return None
    older = n - reads.window
    scores = index_scores(query, key[:, :, :older])[:, 0]  # (B, older)
    top = scores.topk(reads.k, dim=-1).indices.sort(dim=-1).values
    recent = torch.arange(older, n, device=key.device).expand(key.shape[0], -1)
    return torch.cat([top, recent], dim=-1)


class _SparseStore(_SharedStore):
    """The shared store, read at the selected positions only by the targets at a sparse decode step."""

    def __init__(self, *args):
        super().__init__(*args)
        # (B, n) positions of this forward's sparse step, set by the source's attention call;
        # None: the targets read every position (prefill, or a context the reads cover).
        self.selection: torch.Tensor | None = None

    def _entries(self, layer: int, new: int, step: dict):
        if layer == self.plan.source:
            self.selection = None  # a new forward: the source's attention call selects again
        if layer == self.plan.source or self.selection is None:
            return super()._entries(layer, new, step)
        at = self.selection
        width = step["k"].shape[-1]
        k = step["k"].gather(1, at[..., None].expand(-1, -1, width))
        v = step["v"].gather(1, at[..., None].expand(-1, -1, width))
        cos, sin = rotary(self.model, layer, k, at)
        return k, v, cos, sin


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

    def __init__(self, model, plan, group, parts=None, storage: str = "bf16", *, reads: SparseDecode):
        super().__init__(model, plan, group, parts, storage)
        geo = self._store.geo
        sliding = [la for la in (plan.source, *plan.targets) if geo.window(la) is not None]
        if sliding:
            raise NotImplementedError(f"sparse decode keeps no sliding windows; layers {sliding} of the plan have one")
        self.reads = reads
        self._calls = AttentionCalls(attention(model, plan.source), "the sparse decode drops the targets' masks")
        self._modules = {attention(model, la): la for la in (plan.source, *plan.targets)}

    def _make_store(self, *args) -> _SparseStore:
        return _SparseStore(*args)

    def _attend(self, original, module, query, key, value, attention_mask, *args, **kwargs):
        layer, store = self._modules.get(module), self._store
        if layer == self.plan.source and query.shape[2] == 1:
            store.selection = select(query, key, self.reads)
        elif layer is not None and layer != self.plan.source and store.selection is not None:
            attention_mask = None  # one unpadded query sees every entry it was handed
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    @contextmanager
    def feed(self) -> Iterator[SparseSharedKVCache]:
        """The store's hooks and the targets' sparse reads; both always removed."""
        with super().feed(), self._calls.routed(self._attend):
            yield self
