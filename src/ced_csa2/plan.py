"""The layer plan: which layer is cut, which is projected, which are adapted.

A plan is data (``params.plan``), 1-based like the seeds.  It is validated against the
model's geometry before any heavy work: every named layer exists, ``split < source <
targets``, and every projected/adapted layer has softmax attention (on Qwen3.5 the
GatedDeltaNet layers have no K/V to replace), and a sliding-window source feeds only
readers whose window is no wider than its own (its cache forgets older positions; a
full-attention source may feed sliding readers).  Mode A additionally needs a *covering*
plan: every attention layer above the cut must get its K/V from the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig, PlanConfig
from .model_utils import Geometry, geometry, load_config


class PlanError(ValueError):
    """The layer plan does not fit the model; the message names the offending layer."""


@dataclass(frozen=True)
class LayerPlan:
    split: int
    source: int
    targets: tuple[int, ...]
    extra_sources: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, cfg: PlanConfig) -> "LayerPlan":
        return cls(cfg.split, cfg.source, tuple(cfg.targets), tuple(cfg.extra_sources))

    @property
    def projected(self) -> tuple[int, ...]:
        """Layers whose K/V a projector computes from ``H_split`` (the source first)."""
        return (self.source, *self.extra_sources)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Every layer whose true K/V the dump stores, sorted."""
        return tuple(sorted({*self.projected, *self.targets}))

    def validate(self, geo: Geometry) -> "LayerPlan":
        """Raise :class:`PlanError` unless the plan fits ``geo``; returns ``self``."""
        named = [("split", self.split), ("source", self.source)]
        named += [("target", t) for t in self.targets] + [("extra source", e) for e in self.extra_sources]
        for role, layer in named:
            if not 1 <= layer <= geo.n_layers:
                raise PlanError(f"plan {role} layer {layer} does not exist: the model has layers 1..{geo.n_layers}")
        if not self.targets:
            raise PlanError("plan has no target layers")
        kv_named = [self.source, *self.targets, *self.extra_sources]
        twice = sorted({layer for layer in kv_named if kv_named.count(layer) > 1})
        if twice:
            raise PlanError(f"plan names a layer twice: source {self.source}, targets {list(self.targets)}, "
                            f"extra sources {list(self.extra_sources)} "
                            f"(layer {', '.join(map(str, twice))} more than once)")
        if not self.split < self.source:
            raise PlanError(f"plan source layer {self.source} must come after split layer {self.split}")
        for t in self.targets:
            if not self.source < t:
                raise PlanError(f"plan target layer {t} must come after source layer {self.source}")
        for e in self.extra_sources:
            if not self.split < e:
                raise PlanError(f"plan extra source layer {e} must come after split layer {self.split}")
        for role, layer in named[1:]:
            if layer not in geo.attention_layers:
                raise PlanError(f"plan {role} layer {layer} is not a softmax-attention layer (it has no K/V); "
                                f"attention layers are {list(geo.attention_layers)}")
        self._check_windows(geo)
        return self

    def _check_windows(self, geo: Geometry) -> None:
        """A sliding-window source keeps only its last ``window - 1`` positions: no reader may need older ones."""
        window = geo.window(self.source)
        if window is None:
            return
        for t in self.targets:
            reach = geo.window(t)
            if reach is None or reach > window:
                what = "full attention" if reach is None else f"a sliding window of {reach}"
                raise PlanError(
                    f"plan source layer {self.source} is a sliding-window layer (window {window}): its cache keeps only "
                    f"the last {window - 1} positions, but target layer {t} has {what} and would read older ones; "
                    f"choose a full-attention source (full-attention layers: "
                    f"{[la for la in geo.attention_layers if geo.window(la) is None]})")

    def uncovered(self, geo: Geometry) -> list[int]:
        """Attention layers above the cut whose K/V the plan does not provide."""
        covered = set(self.kv_layers)
        return [layer for layer in geo.attention_layers if layer > self.split and layer not in covered]

    def require_covering(self, geo: Geometry) -> "LayerPlan":
        """Mode A check: raise naming the attention layers above the cut left without K/V."""
        missing = self.uncovered(geo)
        if missing:
            raise PlanError(f"plan does not cover attention layers {missing} above split layer {self.split}; "
                            "Mode A needs every one of them as source, target or extra source "
                            "(as conf/plan/smollm2_135m.yaml does for the embedded model)")
        return self


def load_plan(plan_cfg: PlanConfig, model_cfg: ModelConfig) -> tuple[LayerPlan, Geometry]:
    """The validated plan and the model geometry, from the model config alone (no weights)."""
    geo = geometry(load_config(model_cfg))
    return LayerPlan.from_config(plan_cfg).validate(geo), geo
