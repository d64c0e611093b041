"""Runtimes that put the trained maps into a plain HF model (the seed's public API).

* :class:`CEDModeBRuntime` -- *substitution*.  Every token runs through all layers; the
  K/V of planned layers are replaced at the injection point (``k_proj``/``v_proj``
  output, pre-k_norm, pre-RoPE) by forward hooks, installed on ``__enter__`` and always
  removed on ``__exit__``.  Inside the context the model is still a plain HF model,
  so teacher-forced passes, cached ``generate()`` and lm-eval's ``HFLM`` all see the
  substituted K/V.  This is how the ablation table's perplexities are measured.
* :class:`CEDModeARuntime` -- *prefill skip* (true CED).  Prompt tokens run through
  layers ``1..split`` only; every attention layer above the cut gets its prompt K/V
  from the projector(s)/adapters, written into the KV cache after the layer's own
  k_norm and RoPE; generated (or scored) tokens then run through all layers.
  **Approximation:** non-attention layers above the cut (Qwen3.5's GatedDeltaNet
  layers) get no prompt state -- they start from a zero state.

Groups (Mode B) are defined in :mod:`ced_csa2.groups`: ``baseline`` (no change),
``share_plain`` (targets read the true KV_source verbatim, no adapter -- the baseline
every adapter must beat; like vLLM's ``kv_sharing_target_layer_name``, except that each
target still applies its own k_norm), ``ced`` (source K/V from ``projector(H_split)``),
``csa2`` (targets from ``adapters(true KV_source)``), ``ced_csa2`` (targets from
``adapters(projected KV_source)``, source projected too).  FP4 groups store K/V in FP4
(``kv_format``): ``baseline_fp4`` (every attention layer's own K/V), ``csa2_fp4`` and
``ced_csa2_fp4`` (the one shared source entry) -- so the cost of FP4 and of sharing can
be told apart.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

import torch
from torch import nn

from . import kv_hooks
from .checkpoint import expected_meta
from .fp4 import FORMATS as FP4_FORMATS
from .groups import group as lookup_group
from .model_utils import Geometry, attention, decoder_layer, geometry
from .plan import LayerPlan

if TYPE_CHECKING:
    from .config import Params

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class CEDParts:
    """The trained maps of one plan.

    Attributes
    ----------
    projector
        ``H_split (..., hidden) -> (K, V)`` of the source layer, each ``(..., kv_dim)``.
    adapters
        ``adapters(layer, k_src, v_src) -> (k, v)`` for every target layer.
    extra
        ``{layer: projector}`` for the extra sources of a covering plan (Mode A only).
    """

    projector: Callable[[torch.Tensor], KV] | None = None
    adapters: Callable[[int, torch.Tensor, torch.Tensor], KV] | None = None
    extra: dict[int, Callable[[torch.Tensor], KV]] = field(default_factory=dict)

    def project(self, layer: int, plan: LayerPlan, h: torch.Tensor) -> KV:
        fn = self.projector if layer == plan.source else self.extra[layer]
        return _run(fn, fn, h)

    def adapt(self, layer: int, k_src: torch.Tensor, v_src: torch.Tensor) -> KV:
        return _run(self.adapters, lambda k, v: self.adapters(layer, k, v), k_src, v_src)


def _run(owner, fn, *xs: torch.Tensor) -> KV:
    """Apply ``fn`` in the dtype of ``owner``'s parameters (if a module) and return the inputs' dtype."""
    params = next(owner.parameters(), None) if isinstance(owner, nn.Module) else None
    dtype = params.dtype if params is not None else xs[0].dtype
    k, v = fn(*(x.to(dtype) for x in xs))
    return k.to(xs[0].dtype), v.to(xs[0].dtype)


def load_parts(models_dir: Path | str, params: Params, plan: LayerPlan, geo: Geometry, *, device=None, dtype=None,
               also: Mapping | None = None, extra_sources: bool = True) -> CEDParts:
    """Load the maps of ``plan`` from ``models_dir``, each refused unless it was made for them.

    Parameters
    ----------
    models_dir
        Folder of ``projector_k{s}v{s}.pt``, ``adapters.pt`` and ``projectors_extra.pt``.
    params, plan, geo
        What every file must say it is for (:func:`ced_csa2.checkpoint.expected_meta`):
        model name, the layer(s) it maps, ``hidden_size``/``kv_dim`` and the plan.
    device, dtype
        Where and in what dtype to build the modules (default: CPU, float32).
    also
        Further ``{meta key: value}`` every file must hold, e.g. ``{"objective": "distill"}``.
    extra_sources
        Load ``projectors_extra.pt`` when the plan has extra sources (Mode A); ``False``
        for a folder that holds none (``tune@<objective>``).

    Raises
    ------
    CheckpointError
        A file is missing, or was made for another model, layer, geometry or plan: one
        sentence naming the file, the key and both values, before any weight is used.
    """
    from .csa2 import load_adapters
    from .projector import load_projector, load_projectors

    models_dir = Path(models_dir)
    expect = {kind: {**want, **(also or {})} for kind, want in expected_meta(params, plan, geo).items()}
    projector, _ = load_projector(models_dir / f"projector_k{plan.source}v{plan.source}.pt",
                                  expect=expect["projector"], device=device, dtype=dtype)
    adapters = load_adapters(models_dir / "adapters.pt", device=device, dtype=dtype, expect=expect["adapters"])
    extra = {}
    if plan.extra_sources and extra_sources:
        extra, _ = load_projectors(models_dir / "projectors_extra.pt", expect=expect["projectors"], device=device,
                                   dtype=dtype)
    return CEDParts(projector, adapters, extra)


def require_parts(group: str, parts: CEDParts) -> None:
    """Refuse to run ``group`` without the maps it needs (its registry entry says which)."""
    spec = lookup_group(group)
    if spec.projected_source and parts.projector is None:
        raise ValueError(f"group {group!r} needs a projector")
    if spec.adapters and parts.adapters is None:
        raise ValueError(f"group {group!r} needs adapters")


class CEDModeBRuntime:
    """Substitution runtime; use as a context manager around any forward / generate / lm-eval.

    Parameters
    ----------
    model
        A HF causal LM (frozen); left unchanged after ``__exit__``.
    plan
        The validated layer plan.
    group
        One of :data:`ced_csa2.groups.GROUPS`.
    parts
        Trained maps (``projector`` needed by ``ced*``, ``adapters`` by ``*csa2``).
    kv_format
        FP4 format of the ``*_fp4`` groups (``nvfp4`` | ``mxfp4``; required for them, no
        default): the stored K/V are quantised and read back, pre-k_norm and pre-RoPE like
        the shared store keeps them.  Ignored (pass ``None``) for the other groups.
    """

    def __init__(self, model: nn.Module, plan: LayerPlan, group: str, parts: CEDParts | None = None, *,
                 kv_format: str | None):
        spec = lookup_group(group)
        parts = parts or CEDParts()
        require_parts(group, parts)
        if spec.is_fp4 and kv_format not in FP4_FORMATS:
            # No default: an FP4 group must be told its format (params.yaml kv_format).
            raise ValueError(f"group {group!r} stores FP4 and needs kv_format in {list(FP4_FORMATS)}, "
                             f"got {kv_format!r}")
        self.model, self.plan, self.group, self.parts, self.spec = model, plan, group, parts, spec
        self.fp4 = FP4_FORMATS[kv_format]() if spec.is_fp4 else None
        self._stack: ExitStack | None = None
        self._store: dict | None = None

    @property
    def replaced_layers(self) -> tuple[int, ...]:
        """Layers whose K/V this group replaces (or, for FP4 groups, stores quantised)."""
        if self.spec.fp4 == "every_layer":
            return geometry(self.model.config).attention_layers
        return (*self._stored_source, *self._read_targets)

    @property
    def _stored_source(self) -> tuple[int, ...]:
        """The source, when its K/V are replaced by what the store holds (projected and/or FP4)."""
        return (self.plan.source,) if self.spec.projected_source or self.fp4 else ()

    @property
    def _read_targets(self) -> tuple[int, ...]:
        """Targets that read the source's stored K/V (adapted, or verbatim for share_plain)."""
        return self.plan.targets if self.spec.shares_source_kv else ()

    def _fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        """What reading ``x`` back from FP4 storage gives (quantise, then dequantise)."""
        return self.fp4.dequantize(self.fp4.quantize(x), dtype=x.dtype)

    def __enter__(self) -> "CEDModeBRuntime":
        if not self.replaced_layers:  # baseline
            return self
        plan, parts, spec = self.plan, self.parts, self.spec
        uses_ced = spec.projected_source
        stack = ExitStack()
        store = self._store = stack.enter_context(kv_hooks.capture(self.model, [plan.source], [plan.split]))

        def projected() -> KV:
            # Once per forward: every hook of one forward sees the same H_split.
            h = store["h"][plan.split]
            if store.get("proj_of") is not h:
                store["proj_of"], store["proj"] = h, parts.project(plan.source, plan, h)
            return store["proj"]

        def stored(kind: str) -> torch.Tensor:
            # The source K or V as the store holds it: projected (CED) or true, FP4-rounded
            # for *_fp4.  Per kind, because the source's k_proj runs before its v_proj.
            raw = projected()["kv".index(kind)] if uses_ced else store[kind][plan.source]
            memo = store.setdefault(("stored", kind), [None, None])
            if memo[0] is not raw:
                memo[:] = [raw, self._fake_quant(raw) if self.fp4 else raw]
            return memo[1]

        def adapted(layer: int) -> KV:
            src = stored("k"), stored("v")
            key = ("adapted", layer)
            if store.get(key, (None,))[0] is not src[0]:
                store[key] = (src[0], parts.adapt(layer, *src))
            return store[key][1]

        repl: dict = {}
        if spec.fp4 == "every_layer":  # baseline_fp4: every attention layer's own K/V, FP4-rounded
            for layer in self.replaced_layers:
                repl[(layer, "k")] = repl[(layer, "v")] = self._fake_quant
        else:
            for layer in self._stored_source:
                repl[(layer, "k")] = lambda out: stored("k")
                repl[(layer, "v")] = lambda out: stored("v")
            for t in self._read_targets:
                read = adapted if spec.adapters else (lambda _: (stored("k"), stored("v")))  # share_plain
                repl[(t, "k")] = lambda out, t=t, read=read: read(t)[0]
                repl[(t, "v")] = lambda out, t=t, read=read: read(t)[1]
        stack.enter_context(kv_hooks.inject(self.model, repl))
        self._stack = stack
        return self

    def seed(self, *, h_split: torch.Tensor | None = None, source_kv: KV | None = None) -> None:
        """Hand the hooks what they capture (``H_split``, the true source K/V) from a pass they did not see.

        For a forward that starts above ``plan.split`` (or ``plan.source``) from a hidden
        state a shared trunk computed (:func:`ced_csa2.scoring.multi_group_nll`): the
        capture hooks of the skipped layers never fire, so the trunk's tensors stand in
        for them -- exactly what they would have recorded.  Call inside the context,
        before the forward; a no-op for ``baseline`` (no hooks).
        """
        if self._store is None:
            return
        if h_split is not None:
            self._store["h"][self.plan.split] = h_split
        if source_kv is not None:
            self._store["k"][self.plan.source], self._store["v"][self.plan.source] = source_kv

    def __exit__(self, *exc) -> None:
        self._store = None
        if self._stack is not None:
            self._stack.close()
            self._stack = None


class _StopForward(Exception):
    """Raised by a hook to end a forward pass after the split layer."""


def _rope_fn(attn: nn.Module):
    # Each transformers model family defines its own apply_rotary_pos_emb (Qwen3.5's is
    # partial-rotary); use the one the attention module itself calls.
    return sys.modules[type(attn).__module__].apply_rotary_pos_emb


@torch.inference_mode()
def plain_prefill(model: nn.Module, input_ids: torch.Tensor):
    """The unmodified model's cache for ``input_ids`` ``(B, T)``: what Mode A's prefill replaces."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model.model(input_ids=input_ids, cache=cache, use_cache=True)
    return cache


@torch.inference_mode()
def continue_from(model: nn.Module, cache, prompt_ids: torch.Tensor, continuation_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``(B, C, vocab)`` predicting ``continuation_ids`` ``(B, C)``, through all layers.

    ``cache`` holds ``prompt_ids[:, :-1]`` (from :func:`plain_prefill` or
    :meth:`CEDModeARuntime.prefill`); the prompt's last token makes the first prediction.
    """
    x = torch.cat([prompt_ids[:, -1:], continuation_ids[:, :-1]], dim=1)
    return model(input_ids=x, cache=cache, use_cache=True).logits


ZERO_STATE_NOTE = ("Mode A: prompt tokens run through layers 1..split only; attention layers above the cut get "
                   "K/V from the projector/adapters; non-attention layers above the cut start from a zero state "
                   "(an approximation; none on an all-attention model).")


class CEDModeARuntime:
    """Prefill skip: prompt through layers ``1..split``, K/V above the cut from the maps.

    The plan must cover every attention layer above the cut (refused otherwise, naming
    the uncovered layers).  Non-attention layers above the cut start from a zero state.

    Parameters
    ----------
    model, plan, parts
        As for :class:`CEDModeBRuntime`; ``parts.extra`` holds the extra sources.
    geo
        The model's geometry (for the covering check).
    """

    def __init__(self, model: nn.Module, plan: LayerPlan, geo: Geometry, parts: CEDParts):
        plan.require_covering(geo)
        self.model, self.plan, self.geo, self.parts = model, plan, geo, parts

    def predicted_kv(self, h: torch.Tensor) -> dict[int, KV]:
        """``{layer: (K, V)}`` for every covered layer, from ``H_split`` ``(B, T, hidden)``."""
        plan = self.plan
        out = {layer: self.parts.project(layer, plan, h) for layer in plan.projected}
        for t in plan.targets:
            out[t] = self.parts.adapt(t, *out[plan.source])
        return out

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor):
        """Cache for ``input_ids`` ``(B, T)`` (no padding) built with the prefill skip."""
        from transformers import DynamicCache

        model, plan = self.model, self.plan
        cache = DynamicCache(config=model.config)
        h_split = {}

        def stop(mod, inp, out):
            h_split["h"] = out[0] if isinstance(out, tuple) else out
            raise _StopForward

        handle = decoder_layer(model, plan.split).register_forward_hook(stop)
        try:
            model.model(input_ids=input_ids, cache=cache, use_cache=True)
        except _StopForward:
            pass
        finally:
            handle.remove()
        h = h_split["h"]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        cos, sin = model.model.rotary_emb(h, positions)
        for layer, (k, v) in sorted(self.predicted_kv(h).items()):
            attn = attention(model, layer)
            shape = (*k.shape[:-1], -1, attn.head_dim)
            k = k.view(shape)
            if hasattr(attn, "k_norm"):
                k = attn.k_norm(k)
            k = k.transpose(1, 2)
            _, k = _rope_fn(attn)(k, k, cos, sin)
            cache.update(k, v.view(shape).transpose(1, 2), layer - 1)
        return cache

    @torch.inference_mode()
    def continuation_logits(self, prompt_ids: torch.Tensor, continuation_ids: torch.Tensor) -> torch.Tensor:
        """Logits predicting ``continuation_ids`` ``(B, C)`` given a skip-prefilled prompt.

        The prompt's last token runs through all layers (it makes the first prediction),
        so the skip covers ``prompt_ids[:, :-1]``.  Returns ``(B, C, vocab)``.
        """
        return continue_from(self.model, self.prefill(prompt_ids[:, :-1]), prompt_ids, continuation_ids)

    @torch.inference_mode()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int,
                 stop: Callable[[torch.Tensor], bool] | None = None) -> torch.Tensor:
        """Greedy decoding after a skip prefill; the new tokens ``(B, n <= max_new_tokens)``.

        ``stop(new_tokens)`` is asked after each step and ends decoding when true.
        """
        cache = self.prefill(prompt_ids[:, :-1])
        x, out = prompt_ids[:, -1:], []
        for _ in range(max_new_tokens):
            logits = self.model(input_ids=x, cache=cache, use_cache=True).logits
            x = logits[:, -1:].argmax(-1)
            out.append(x)
            if stop is not None and stop(torch.cat(out, dim=1)):
                break
        return torch.cat(out, dim=1)
