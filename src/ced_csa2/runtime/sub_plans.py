"""Several Full layers above the cut: one single-source sharing plan per Full layer, their runtimes nested.

DeepSeek-V4.1 keeps a few *Full* layers whose caches the other global layers reuse (seed 003
§4.3). On the single-source code path that is ``k`` ordinary plans over disjoint layers -- the
*sub-plans*: Full layer ``f_j`` is sub-plan ``j``'s source and serves the attention layers above
it up to the next Full layer as its targets.  Each sub-plan gets its own
:class:`~ced_csa2.ced_runtime.CEDModeBRuntime`, and :class:`NestedRuntimes` enters them one inside
the other: their hooks sit on disjoint layers, so nothing in the runtime changes.  A Full layer
above the first one computes its K/V from a residual stream the readers below it have already
changed, as it would in a model served that way.

FP4 on every stored copy (the ``baseline_fp4`` recipe with sharing on top) is one more runtime,
an every-layer FP4 group, nested *outside* the sharing ones: its rounding hooks are installed
first, so a sub-plan's capture of its source (installed after) reads the FP4 entry its store
holds, and a reader's replacement (installed after) overrides the rounding of a cache the reader
does not keep.  The order is what the composition means, so :class:`NestedRuntimes` enforces it.

Bytes per token compose the same way (:func:`nested_copies`): a layer keeps a cache when every
nested runtime keeps it, in the smallest entry any of them stores it as.

Served with real bytes, the sub-plans are one cache (:class:`SubPlansSharedKVCache`): each Full
layer's :class:`~ced_csa2.runtime.shared_kv.SharedKVCache` store, its readers storing nothing, and
every other layer an ordinary ``DynamicLayer``.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Iterator, Mapping, Sequence

from torch import nn
from transformers import DynamicCache

from ..ced_runtime import CEDModeBRuntime, CEDParts
from ..kv.kv_bytes import StoredCopy
from ..model_utils import Geometry
from ..plan import LayerPlan, PlanError
from .group_runtime import GroupRuntime
from .shared_kv import SharedKVCache
from .sparse_decode import SparseDecode, SparseSharedKVCache


def spaced_full_layers(geo: Geometry, split: int, k: int) -> tuple[int, ...]:
    """``k`` Full layers evenly spaced over the attention layers above ``split``, the first of them first.

    Full layer ``j`` (0-based) is the attention layer above the cut at index ``floor(j · n / k)`` of
    the ``n`` there (SmolLM2, cut after 15: ``k = 2`` → 16, 23; ``k = 4`` → 16, 19, 23, 27), so every
    Full layer serves ``floor(n / k) - 1`` or ``ceil(n / k) - 1`` readers and no reader is further
    from its Full layer than it must be.

    Raises
    ------
    PlanError
        When ``k`` Full layers would leave one of them without a reader (``k > n / 2``) or ``k < 1``.
    """
    above = [layer for layer in geo.attention_layers if layer > split]
    if not 1 <= k <= len(above) // 2:
        raise PlanError(f"{k} Full layers over the {len(above)} attention layers above split layer {split}: each "
                        f"needs at least one reader, so 1 <= k <= {len(above) // 2}")
    return tuple(above[j * len(above) // k] for j in range(k))


def sub_plans(geo: Geometry, split: int, full_layers: Sequence[int]) -> list[LayerPlan]:
    """One validated single-source plan per Full layer: its readers are the attention layers above it,
    up to the next Full layer.

    ``full_layers`` must start with the first attention layer above ``split`` (every layer above
    the cut then has a Full layer below it) and increase.
    """
    above = [layer for layer in geo.attention_layers if layer > split]
    full = list(full_layers)
    if not full or full[0] != above[0] or full != sorted(set(full)) or not set(full) <= set(above):
        raise PlanError(f"Full layers {full} must be increasing attention layers above split layer {split}, the "
                        f"first of them {above[0]}")
    ends = [*full[1:], max(above) + 1]
    return [LayerPlan(split, f, tuple(la for la in above if f < la < end)).validate(geo) for f, end in zip(full, ends)]


class NestedRuntimes(GroupRuntime):
    """Mode B runtimes entered one inside the other (the first outermost), scored like one group.

    Parameters
    ----------
    runtimes
        Zero or one every-layer FP4 runtime (``baseline_fp4``, ``baseline_fp4_rot``), then one
        sharing runtime (``csa2``, ``ced_csa2``, ``csa2_fp4_rot``, ...) per sub-plan.  The sub-plans
        share the split, and no layer is a source or reader of two of them.

    A :class:`~ced_csa2.runtime.group_runtime.GroupRuntime` (:func:`ced_csa2.eval.scoring.multi_group_nll`'s
    ``extra=``): ``replaced_layers`` reaches down to every sub-plan's source, so the shared trunk stops at or
    below each of them and each sub-plan's own hooks capture its source K/V (the trunk captures
    only the plan it is given); ``seed`` hands every runtime the trunk's ``H_split``.
    """

    def __init__(self, runtimes: Sequence[CEDModeBRuntime]):
        outer = [rt for rt in runtimes if rt.spec.fp4 == "every_layer"]
        sharing = [rt for rt in runtimes if rt.spec.shares_source_kv]
        if len(outer) > 1 or list(runtimes) != outer + sharing or not sharing:
            raise ValueError(f"NestedRuntimes: give at most one every-layer FP4 runtime, then one sharing runtime per "
                             f"sub-plan; got groups {[rt.group for rt in runtimes]}")
        if outer and any(rt.spec.is_fp4 for rt in sharing):
            raise ValueError("NestedRuntimes: an every-layer FP4 runtime already rounds each sub-plan's source; a "
                             f"sharing group with FP4 of its own ({[rt.group for rt in sharing]}) would round it twice")
        splits = {rt.plan.split for rt in sharing}
        layers = [la for rt in sharing for la in (rt.plan.source, *rt.plan.targets)]
        if len(splits) > 1 or len(set(layers)) != len(layers):
            raise PlanError(f"NestedRuntimes: the sub-plans must share one split and no layer, got "
                            f"{[(rt.plan.split, rt.plan.source, list(rt.plan.targets)) for rt in sharing]}")
        self.runtimes, self.sharing = list(runtimes), sharing
        self.spec = sharing[0].spec  # multi_group_nll reads spec.low_rank: False (no xKV runtime is shared)
        self._stack: ExitStack | None = None

    @property
    def replaced_layers(self) -> tuple[int, ...]:
        """Every layer any runtime changes, and every sub-plan's source (its capture must run)."""
        return tuple(sorted({*(la for rt in self.runtimes for la in rt.replaced_layers),
                             *(rt.plan.source for rt in self.sharing)}))

    def seed(self, *, h_split=None, **_) -> None:
        """Hand every runtime the trunk's ``H_split`` ``(B, T, hidden)``; the source K/V are never needed, since the
        branch point is at or below every source (:attr:`replaced_layers`)."""
        for rt in self.runtimes:
            rt.seed(h_split=h_split)

    def __enter__(self) -> "NestedRuntimes":
        with ExitStack() as stack:
            for rt in self.runtimes:
                stack.enter_context(rt)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        if self._stack is not None:
            self._stack.__exit__(*exc)
            self._stack = None


def nested_copies(copies: Sequence[Sequence[StoredCopy]]) -> list[StoredCopy]:
    """What nested runtimes store per token, from each one's own copies (:func:`~ced_csa2.kv.kv_bytes.kv_copies`).

    A copy is held when every runtime holds it (a reader of any sub-plan keeps none), in the
    smallest entry any runtime stores it as (an FP4 rounding applies whichever runtime makes it).
    Copies keep the first list's order.
    """
    held = [{c.name: c for c in cs} for cs in copies]
    return [min((h[c.name] for h in held), key=lambda x: x.entry_bytes) for c in copies[0]
            if all(c.name in h for h in held)]


class SubPlansSharedKVCache(DynamicCache):
    """One ``DynamicCache`` holding a :class:`~ced_csa2.runtime.shared_kv.SharedKVCache` store per sub-plan.

    Each sub-plan's source stores its pre-norm K/V once and its readers nothing (their K/V rebuilt
    from it at every forward, through their own adapters); every other layer is an ordinary
    ``DynamicLayer``.  The sub-plans' layers are disjoint (:class:`NestedRuntimes`' rule), so each
    sub-plan's cache layers are taken over as they are.

    Parameters
    ----------
    model
        The HF causal LM the cache is used with.
    plans
        The sub-plans (:func:`sub_plans`): one split, no layer in two of them.
    group, storage, rotate
        As for :class:`~ced_csa2.runtime.shared_kv.SharedKVCache`, the same for every sub-plan (``rotate``:
        each Full layer's FP4 entries rotated by its own layer's rotation, as ``csa2_fp4_rot`` stores its source's).
    parts
        ``{plan: CEDParts}``: each sub-plan's maps.
    reads
        Each sub-plan's store a :class:`~ced_csa2.runtime.sparse_decode.SparseSharedKVCache` with these reads
        (the oracle: each Full layer ranks its older entries by its own logits); ``None``: every reader reads
        every entry.  The sparse caches' attention routes nest (each passes the others' layers on).  The sparse
        stores keep no rotated entries: ``reads`` with ``rotate`` is refused.
    """

    def __init__(self, model: nn.Module, plans: Sequence[LayerPlan], group: str, parts: Mapping[LayerPlan, CEDParts],
                 storage: str = "bf16", *, rotate: bool = False, reads: SparseDecode | None = None):
        layers = [la for p in plans for la in p.kv_layers]
        if len({p.split for p in plans}) != 1 or len(set(layers)) != len(layers):
            raise PlanError(f"SubPlansSharedKVCache: the sub-plans must share one split and no layer, got "
                            f"{[(p.split, p.source, list(p.targets)) for p in plans]}")
        if rotate and reads is not None:
            raise ValueError("SubPlansSharedKVCache: the sparse stores (reads) keep no rotated entries; give rotate "
                             "or reads, not both")
        super().__init__(config=model.config)
        self.plans = list(plans)
        self.caches = [SharedKVCache(model, p, group, parts[p], storage, rotate=rotate) if reads is None else
                       SparseSharedKVCache(model, p, group, parts[p], storage, reads=reads) for p in plans]
        for plan, cache in zip(self.plans, self.caches):
            for layer in plan.kv_layers:
                self.layers[layer - 1] = cache.layers[layer - 1]

    @contextmanager
    def feed(self) -> Iterator["SubPlansSharedKVCache"]:
        """Every sub-plan's store fed (:meth:`~ced_csa2.runtime.shared_kv.SharedKVCache.feed`); always unhooked."""
        with ExitStack() as stack:
            for cache in self.caches:
                stack.enter_context(cache.feed())
            yield self
