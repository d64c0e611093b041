"""A KV cache that holds xKV's bytes: ``xkv.rank`` cross-layer coefficients per token for K and for V.

The ``xkv`` group (:mod:`ced_csa2.maps.xkv`) stands for the K/V of its layers ``(source, *targets)``
by one entry per token and stream: ``c = [k_source; k_t1; ...] @ U_r`` (``XKVBasis.compress``,
pre-k_norm and pre-RoPE rows), the bases ``U_r`` being weights.  :class:`LowRankKVCache` stores
exactly that, in the model's dtype, and nothing else for those layers; every other attention
layer keeps its ordinary entries.  A group layer reads, for every cached position it attends,
its ``kv_dim`` block of ``U_r c`` (``XKVBasis.reconstruct``), then its own k_norm and RoPE at
each position -- the shared store's rebuild (:class:`~ced_csa2.runtime.shared_kv.SharedKVCache`,
whose position and RoPE machinery this reuses, left padding included).

**Causality.**  A token's coefficients need the K/V of *all* group layers, but the lowest group
layer attends before the higher ones have computed theirs.  So within one forward (a prefill
chunk or a decode step) each group layer attends over the reconstructed *past* plus the current
chunk's *exact* own entries (its ``key_states``/``value_states``, already normed and rotated);
when the top group layer has written its K/V, the chunk's coefficients are computed from all
group layers' exact ``k_proj``/``v_proj`` outputs of this forward and appended, and the exact
entries are dropped.  The prefill is therefore the plain model's, and its coefficients are those
of the clean K/V, as xKV's compressed clean prefill.

**Where it differs from the teacher-forced ``xkv``** (:class:`~ced_csa2.ced_runtime.CEDModeBRuntime`):
there every position, the current one included, reads its reconstruction; here the current chunk
reads its exact entries, and a decoded token's coefficients compress K/V computed over the
reconstructed past (not a clean pass).  Greedy tokens may therefore differ from Mode B's twin.
What is exact: after a prefill of ``T`` tokens, a decode step's logits equal a teacher-forced pass
of ``T + 1`` tokens in which every position ``< T`` holds its clean K/V (the group layers' read
back from their coefficients) and position ``T`` its own (``tests/test_low_rank_kv.py``).

Transient per forward: the reconstruction of every group layer over the cached positions,
``(B, T, L · kv_dim)`` per stream, built once and dropped after the top group layer (read-time
compute, as the shared store's adapters).  A sliding-window source's store keeps its last
``window - 1`` coefficients, as the accounting counts them (the plan refuses a reader that would
need older ones).  Limits are :class:`~ced_csa2.runtime.shared_kv.SharedKVCache`'s: unpadded or
left-padded batches, no beam search, cropping or batch reshaping.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import DynamicCache

from .. import kv_hooks
from ..ced_runtime import CEDParts, require_parts
from ..maps.xkv import KINDS, XKVBasis, group_layers
from ..model_utils import Geometry, geometry
from ..plan import LayerPlan
from .shared_kv import KV, row_offsets, SharedLayer, SharedStore


class _CoefficientStore(SharedStore):
    """The group's K and V coefficients ``(B, T, rank)`` each (``self.k``, ``self.v``) and the reads from them.

    Parameters
    ----------
    model, plan
        As for :class:`LowRankKVCache`.
    basis
        The group's cross-layer bases (layers ``(source, *targets)``).
    geo
        The model's geometry (sliding windows).
    """

    def __init__(self, model: nn.Module, plan: LayerPlan, basis: XKVBasis, geo: Geometry):
        super().__init__(model, plan, "xkv", CEDParts(xkv=basis), None, geo, {})
        self.basis, self.top = basis, max(basis.layers)

    def write(self, new: int, update_kwargs: dict) -> None:
        """Append the coefficients of this forward's ``new`` positions, from every group layer's exact captured
        ``k_proj``/``v_proj`` outputs ``(B, new, kv_dim)``; the captured entries are dropped."""
        if self.captured is None:
            raise RuntimeError("LowRankKVCache has nothing to store: run the model inside `with cache.feed():` "
                               "(group_cache's open does), so the group layers' K/V are captured")
        rows = {kind: {layer: self.captured[kind].pop(layer, None) for layer in self.basis.layers} for kind in KINDS}
        missing = [layer for kind in KINDS for layer, x in rows[kind].items() if x is None or x.shape[1] != new]
        if missing:
            raise RuntimeError(f"no captured K/V of group layers {sorted(set(missing))} for the {new} new positions "
                               "of this forward")
        first = rows["k"][self.plan.source]
        if self.seen == 0:
            self.pads = torch.zeros(first.shape[0], dtype=torch.long, device=first.device)
        self.pads = row_offsets(update_kwargs, self.seen, new, self.pads)
        # Rounded to the model's dtype: what the cache holds (XKVBasis.forward rounds the same way).
        self.k.append(self.basis.compress("k", rows["k"]).to(first.dtype))
        self.v.append(self.basis.compress("v", rows["v"]).to(first.dtype))
        self.seen += new
        self._step = None
        source_window = self.geo.window(self.plan.source)
        if source_window is not None:  # no reader's window reaches further back (plan validation)
            self.k.keep_last(source_window - 1)
            self.v.keep_last(source_window - 1)

    def read_past(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> KV:
        """``layer``'s K and V ``(B, n_kv, T' + new, head_dim)``: its reconstructed past, k_norm and RoPE applied
        (the last ``window - 1`` positions for a sliding layer), then this forward's exact ``key_states`` /
        ``value_states`` ``(B, n_kv, new, head_dim)``."""
        if len(self.k) == 0:  # the first forward: nothing cached, the exact entries alone
            return key_states, value_states
        if self._step is None:  # once per forward, shared by every group layer
            c = {"k": self.k.read(), "v": self.v.read()}
            self._step = {"rope": self._rope_per_type(c["k"], self._positions(c["k"])),
                          **{kind: self.basis.reconstruct(kind, c[kind]) for kind in KINDS}}
        window = self.geo.window(layer)
        visible = len(self.k) if window is None else min(len(self.k), window - 1)
        k, v = (self._step[kind][layer][:, -visible:].to(key_states.dtype) for kind in KINDS)
        cos, sin = (x[:, -visible:] for x in self._step["rope"](layer))
        k, v = self._norm_rope(self.attn[layer], k, v, cos, sin)
        return torch.cat([k, key_states], dim=-2), torch.cat([v, value_states], dim=-2)


class _CoefficientLayer(SharedLayer):
    """Cache layer of a group layer: holds nothing itself (the store's bytes count with the source's layer)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> KV:
        out = self.store.read_past(self.layer, key_states, value_states)
        if self.layer == self.store.top:  # every group layer's exact K/V of this forward is in: compress them
            self.store.write(key_states.shape[-2], kwargs)
        self.is_initialized = True
        return out


class LowRankKVCache(DynamicCache):
    """``DynamicCache`` in which the ``xkv`` group's layers store ``rank`` coefficients per token for K and for V.

    Parameters
    ----------
    model
        The HF causal LM (its RoPE, k_norms and config are read).
    plan
        The layer plan; the bases must span ``(plan.source, *plan.targets)``.
    parts
        ``parts.xkv``: the group's :class:`~ced_csa2.maps.xkv.XKVBasis`.

    Examples
    --------
    >>> cache = LowRankKVCache(model, plan, parts)                  # doctest: +SKIP
    >>> with cache.feed():                                          # doctest: +SKIP
    ...     model(input_ids=ids, cache=cache, use_cache=True)
    """

    def __init__(self, model: nn.Module, plan: LayerPlan, parts: CEDParts | None):
        parts = parts or CEDParts()
        require_parts("xkv", parts)
        if tuple(parts.xkv.layers) != group_layers(plan):
            raise ValueError(f"LowRankKVCache: the xkv bases span layers {list(parts.xkv.layers)}, the plan's source "
                             f"and targets are {list(group_layers(plan))}")
        geo = geometry(model.config)
        plan.validate(geo)
        super().__init__(config=model.config)
        self.plan, self.group, self.rank = plan, "xkv", parts.xkv.rank
        self._store = _CoefficientStore(model, plan, parts.xkv, geo)
        for layer in group_layers(plan):
            self.layers[layer - 1] = _CoefficientLayer(self._store, layer)

    @contextmanager
    def feed(self) -> Iterator[LowRankKVCache]:
        """Install the hooks that capture the group layers' exact K/V for the coefficients; always removed."""
        store = self._store
        try:
            with kv_hooks.capture(store.model, group_layers(self.plan)) as captured:
                store.captured = captured
                yield self
        finally:
            store.captured = None

