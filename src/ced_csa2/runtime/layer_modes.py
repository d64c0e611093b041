"""DeepSeek-V4.1's layer modes (Full / Reindex / Reuse) on the retrofitted model, as data.

Seed 002 and seed 003 §4.3 (docs/design.md §7): every global-attention layer ``l`` has a *KV
source* ``κ(l)`` and an *index source* ``ι(l)`` -- V4.1's config lists
``kv_source_layer_ids`` / ``index_source_layer_ids`` (0-based there, **1-based** here, as
everywhere in this project).  ``= l`` means the layer makes it itself:

=========  ==========  ============  ==========================================
mode       ``κ(l)``    ``ι(l)``      what the layer does
=========  ==========  ============  ==========================================
Full       ``l``       ``l``         own KV, its own top-k selection
Reindex    earlier     ``l``         another layer's KV, its own selection
Reuse      earlier     earlier       another layer's KV and ``ι(l)``'s selection
=========  ==========  ============  ==========================================

"Own KV with another layer's index" is not a mode: an index lists entries of one KV.

On the retrofitted model the KV sources are not free: they are what the Mode B group's
maps supply (:func:`kv_sources`).  Under a sharing group (``csa2``, ``ced_csa2``,
``share_plain``) the plan's targets read the source's stored KV (through their adapters),
so ``κ(t) = source``; every other attention layer above the cut keeps its own
(``baseline``: all of them).  The *sparse layers* are the attention layers above the cut
(``plan.split``); layers at or below it read densely.

A :class:`LayerModes` is validated (:meth:`LayerModes.validate`) before any heavy work;
each failure is a :class:`ModeError` (a :class:`~ced_csa2.plan.PlanError`) in one sentence
naming the layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..model_utils import Geometry
from ..plan import LayerPlan, PlanError
from ..groups import group as lookup_group

MODES = ("full", "reindex", "reuse")
SHORT = {"full": "F", "reindex": "X", "reuse": "R"}  # seed 003 §4.3's letters


class ModeError(PlanError):
    """A layer-mode assignment that is not a mode, or does not fit the model; names the layer."""


def sparse_layers(plan: LayerPlan, geo: Geometry) -> tuple[int, ...]:
    """The attention layers above the cut (1-based, ascending): the layers that read sparsely."""
    return tuple(layer for layer in geo.attention_layers if layer > plan.split)


def kv_sources(plan: LayerPlan, geo: Geometry, kv_group: str) -> dict[int, int]:
    """``{layer: κ(layer)}`` over the sparse layers, as Mode B group ``kv_group`` supplies the KV."""
    shares = lookup_group(kv_group).shares_source_kv
    return {layer: plan.source if shares and layer in plan.targets else layer for layer in sparse_layers(plan, geo)}


@dataclass(frozen=True)
class LayerModes:
    """KV and index source of every sparse layer (1-based ids, V4.1's two lists as mappings).

    Attributes
    ----------
    kv_source
        ``{layer: κ(layer)}``: where the KV the layer reads is stored (itself: its own).
    index_source
        ``{layer: ι(layer)}``: whose top-k selection the layer attends over (itself: its own).
    """

    kv_source: Mapping[int, int]
    index_source: Mapping[int, int]

    @classmethod
    def build(cls, plan: LayerPlan, geo: Geometry, kv_group: str,
              index_source_layer_ids: Mapping[int, int] | None = None,
              kv_source_layer_ids: Mapping[int, int] | None = None) -> "LayerModes":
        """The validated modes of ``kv_group``'s KV with the listed index sources (others: their own).

        ``kv_source_layer_ids``, when given, must say what ``kv_group`` supplies (layers not
        listed: their own KV); it is checked, never a way to change where the KV comes from.
        """
        supplied = kv_sources(plan, geo, kv_group)
        index = {int(k): int(v) for k, v in (index_source_layer_ids or {}).items()}
        for layer in (*index, *(kv_source_layer_ids or {})):
            if layer not in supplied:
                raise ModeError(f"layer modes name layer {layer}, which is not an attention layer above the cut "
                                f"(split {plan.split}); the sparse layers are {list(supplied)}")
        for layer, src in (kv_source_layer_ids or {}).items():
            if int(src) != supplied[int(layer)]:
                have = "its own KV" if supplied[int(layer)] == int(layer) else f"KV_{supplied[int(layer)]}"
                raise ModeError(f"layer {layer} is given KV source {src}, but group {kv_group!r} gives it {have} "
                                f"(only the plan's targets {list(plan.targets)} read KV_{plan.source}, and only "
                                f"under a sharing group)")
        modes = cls(supplied, {layer: index.get(layer, layer) for layer in supplied})
        return modes.validate(geo)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.kv_source))

    def mode(self, layer: int) -> str:
        """``"full"``, ``"reindex"`` or ``"reuse"`` (of a valid assignment)."""
        if self.kv_source[layer] == layer:
            return "full"
        return "reindex" if self.index_source[layer] == layer else "reuse"

    def selecting(self, layer: int) -> bool:
        """The layer runs its own indexer (Full or Reindex)."""
        return self.index_source[layer] == layer

    def validate(self, geo: Geometry | None = None) -> "LayerModes":
        """Raise :class:`ModeError` (naming the layer) unless every layer has a mode; returns ``self``.

        Rules: a KV source is the layer itself or an earlier layer that stores its own KV;
        a layer with its own KV makes its own selection; an index source is an earlier Full
        or Reindex layer selecting entries of the same KV; with ``geo``, a layer and its
        index source see the same key positions (the same sliding window, or none).
        """
        if set(self.kv_source) != set(self.index_source):
            raise ModeError(f"layer modes give KV sources for layers {sorted(self.kv_source)} but index sources for "
                            f"{sorted(self.index_source)}: every sparse layer needs both")
        for layer in self.layers:
            kv, idx = self.kv_source[layer], self.index_source[layer]
            if kv != layer:
                if kv not in self.kv_source or kv > layer:
                    raise ModeError(f"layer {layer} takes its KV from layer {kv}, which is not an earlier sparse layer")
                if self.kv_source[kv] != kv:
                    raise ModeError(f"layer {layer} takes its KV from layer {kv}, which stores none of its own "
                                    f"(it reads KV_{self.kv_source[kv]}); a KV source must be a Full layer")
            if idx == layer:
                continue
            if kv == layer:
                raise ModeError(f"layer {layer} has its own KV but the index of layer {idx}: own KV with another "
                                "layer's index is not a mode (an index lists entries of one KV)")
            if idx not in self.index_source or idx > layer:
                raise ModeError(f"layer {layer} takes its index from layer {idx}, which is not an earlier sparse layer")
            if self.index_source[idx] != idx:
                raise ModeError(f"layer {layer} takes its index from layer {idx}, a Reuse layer; an index source must "
                                "be a Full or Reindex layer")
            if self.kv_source[idx] != kv:
                raise ModeError(f"layer {layer} reads KV_{kv} but takes its index from layer {idx}, which selects "
                                f"entries of KV_{self.kv_source[idx]}")
            if geo is not None and geo.window(idx) != geo.window(layer):
                raise ModeError(f"layer {layer} (window {geo.window(layer)}) takes its index from layer {idx} "
                                f"(window {geo.window(idx)}): their caches hold different positions")
        return self

    def pool_sources(self) -> tuple[int, ...]:
        """Full layers whose KV some Reindex layer reads: each makes an HSI candidate pool."""
        return tuple(sorted({self.kv_source[la] for la in self.layers if self.mode(la) == "reindex"}))

    def rows(self) -> list[dict]:
        """One row per sparse layer: ``layer``, ``mode``, ``kv_source``, ``index_source``."""
        return [{"layer": la, "mode": self.mode(la), "kv_source": self.kv_source[la],
                 "index_source": self.index_source[la]} for la in self.layers]

    def compact(self) -> str:
        """The layers by mode in seed 003's letters, runs joined: ``"16–21 F · 22 X · 23–25 F · 26 R(22)"``."""
        parts: list[list] = []
        for la in self.layers:
            tag = SHORT[self.mode(la)] + (f"({self.index_source[la]})" if self.mode(la) == "reuse" else "")
            if parts and parts[-1][2] == tag and parts[-1][1] == la - 1:
                parts[-1][1] = la
            else:
                parts.append([la, la, tag])
        return " · ".join(f"{a}–{b} {t}" if a != b else f"{a} {t}" for a, b, t in parts)
