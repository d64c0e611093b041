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
be told apart; their ``*_fp4_rot`` twins rotate each FP4 entry per head by a fixed
randomised Hadamard matrix before FP4 and back after reading (:mod:`ced_csa2.kv.rotation`).
``xkv`` (the training-free low-rank baseline, :mod:`ced_csa2.maps.xkv`): source
and targets read their blocks of the cross-layer SVD reconstruction of the *clean* K/V
(a compressed clean prefill), teacher-forced only -- a forward with a KV cache is refused; cached
decoding goes through :class:`~ced_csa2.runtime.low_rank_kv.LowRankKVCache` instead.
"""

from __future__ import annotations

import hashlib
import inspect
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

import torch
from torch import nn

from . import kv_hooks
from .kv.formats import FP4_FORMATS, format_replacements, group_format
from .kv.rotation import HeadRotation, fp4_round_trip, stream_rotations
from .maps.xkv import XKVBasis, load_xkv
from .model_utils import Geometry, attention, decoder_layer, geometry, layer_type, rope_fn, rotary
from .pipeline.checkpoint import (check_meta_provenance, expected_meta, load_checkpoint, load_state,
                                  save_checkpoint)
from .pipeline.map_roles import MAIN, MODE_A, PAIRS, SEED_INIT_ROLE, Role, objective
from .pipeline.paths import SEED_INIT_MODELS, objective_pair_models, projector_path
from .plan import LayerPlan
from .runtime.group_runtime import GroupRuntime
from .groups import GROUPS
from .groups import group as lookup_group

if TYPE_CHECKING:
    from .config import Params
    from .projector import ProjectorBank

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
    xkv
        The cross-layer bases of the ``xkv`` group (:class:`~ced_csa2.maps.xkv.XKVBasis`):
        ``xkv({layer: k}, {layer: v}) -> {layer: (k̂, v̂)}`` over ``(source, *targets)``.
    sink
        The attention sink's K/V above the cut (:class:`SinkKV`; Mode A's ``sink="mean"``).
    bank
        Mode A's projectors as one :class:`~ced_csa2.projector.ProjectorBank` (``mode_a.train.rank > 0``):
        the source's and the extra sources' maps through one shared basis, in place of
        ``projector`` and ``extra``.
    """

    projector: Callable[[torch.Tensor], KV] | None = None
    adapters: Callable[[int, torch.Tensor, torch.Tensor], KV] | None = None
    extra: dict[int, Callable[[torch.Tensor], KV]] = field(default_factory=dict)
    xkv: XKVBasis | None = None
    sink: "SinkKV | None" = None
    bank: "ProjectorBank | None" = None

    def project(self, layer: int, plan: LayerPlan, h: torch.Tensor) -> KV:
        if self.bank is not None:
            return _run(self.bank, lambda x: self.bank.project(layer, x), h)
        fn = self.projector if layer == plan.source else self.extra[layer]
        return _run(fn, fn, h)

    def project_all(self, plan: LayerPlan, h: torch.Tensor) -> dict[int, KV]:
        """``{layer: (K, V)}`` of every projected layer (source and extra sources) from ``H_split`` ``(..., hidden)``;
        a bank computes its basis once for all of them."""
        if self.bank is None:
            return {layer: self.project(layer, plan, h) for layer in plan.projected}
        w = next(self.bank.parameters())
        return {layer: (k.to(h.device, h.dtype), v.to(h.device, h.dtype))
                for layer, (k, v) in self.bank(h.to(w.device, w.dtype)).items()}

    def maps(self) -> list[nn.Module]:
        """The map modules held (projector, adapters, extra projectors, bank; not the xKV bases or the sink)."""
        held = (self.projector, self.adapters, *self.extra.values(), self.bank)
        return [m for m in held if isinstance(m, nn.Module)]

    def adapt(self, layer: int, k_src: torch.Tensor, v_src: torch.Tensor) -> KV:
        return _run(self.adapters, lambda k, v: self.adapters(layer, k, v), k_src, v_src)


class SinkKV(nn.Module):
    """The attention sink's K/V in the layers above the cut: one constant ``(K, V)`` per layer.

    Position 0 attends to itself only, and from the first layers on its hidden state is
    dominated by the model's massive activations, whatever the token: on the embedded
    default its K/V above the cut differ little from their mean over 128 training records' first
    tokens, while no map of ``H_split`` fitted over all positions comes close (both figures:
    ``docs/results.md``, "Mode A").  So Mode A reads the first position's
    K/V above the cut from these constants: the mean over the training records' first
    positions (:func:`ced_csa2.train.mode_a_training.mean_sink`), pre-k_norm and pre-RoPE like
    every map's output (RoPE at position 0 is the identity).

    Parameters
    ----------
    layers
        The layers it holds, sorted.
    kv_dim
        Width of one K or V row.
    """

    def __init__(self, layers, kv_dim: int):
        super().__init__()
        self.layers = tuple(layers)
        self.register_buffer("k", torch.zeros(len(self.layers), kv_dim))
        self.register_buffer("v", torch.zeros(len(self.layers), kv_dim))

    def forward(self, layer: int) -> KV:
        """``(k, v)`` of ``layer``, each ``(kv_dim,)``."""
        i = self.layers.index(layer)
        return self.k[i], self.v[i]

    def stacked(self, layers) -> KV:
        """``(k, v)`` of ``layers`` in that order, each ``(len(layers), kv_dim)``."""
        i = [self.layers.index(layer) for layer in layers]
        return self.k[i], self.v[i]


SINK_KIND = "mode_a_sink"
BANK_FILE = "projector_bank.pt"  # Mode A's projectors as one bank (mode_a.train.rank > 0), in models/mode_a/
EXTRA_FILE = "projectors_extra.pt"  # the extra sources' projectors (covering plans)
ADAPTERS_FILE = "adapters.pt"


def save_sink(path: Path | str, sink: SinkKV, meta: Mapping) -> Path:
    """Write ``sink`` with ``meta`` (:func:`~ced_csa2.pipeline.checkpoint.checkpoint_meta`'s ``"sink"``)."""
    return save_checkpoint(path, SINK_KIND, sink, {**meta, "layers": list(sink.layers)},
                           ("role", "model", "layers", "kv_dim"))


def load_sink(path: Path | str, expect: Mapping, device=None) -> tuple[SinkKV, dict]:
    """A file of :func:`save_sink`, refused unless it is ``tune_mode_a``'s (role ``mode_a``) and holds
    ``expect`` (model, layers, geometry, plan)."""
    state, meta = load_checkpoint(path, SINK_KIND, expect, role=MODE_A)
    sink = SinkKV(meta["layers"], meta["kv_dim"])
    load_state(Path(path), sink, state)
    return sink.to(device=device, dtype=torch.float32), meta


def _run(owner, fn, *xs: torch.Tensor) -> KV:
    """Apply ``fn`` on the device and in the dtype of ``owner``'s parameters (if a module); return the inputs'.

    The device moves matter only under ``model.device_map: auto`` across GPUs, where the
    maps sit on the model's first device and a layer's activations may be on another.
    """
    params = next(owner.parameters(), None) if isinstance(owner, nn.Module) else None
    device, dtype = (params.device, params.dtype) if params is not None else (xs[0].device, xs[0].dtype)
    k, v = fn(*(x.to(device, dtype) for x in xs))
    return k.to(xs[0].device, xs[0].dtype), v.to(xs[0].device, xs[0].dtype)


def save_parts(models_dir: Path | str, parts: CEDParts, plan: LayerPlan, meta: Mapping[str, Mapping], *,
               extra_sources: bool = True) -> None:
    """Write ``parts`` into ``models_dir`` as :func:`load_parts` (and :func:`load_mode_a_parts`'s sink) read them.

    Parameters
    ----------
    models_dir
        The folder, e.g. ``models/mode_a/`` or an objective pair's
        (:func:`ced_csa2.pipeline.paths.objective_pair_models`).
    parts
        The maps, moved to the CPU here: the projectors as ``parts.bank`` or as ``parts.projector``
        (and ``parts.extra``), ``parts.adapters``, and ``parts.sink`` when it holds one.  Not the xKV
        bases: stage ``fit_xkv`` writes those.
    meta
        :func:`ced_csa2.pipeline.checkpoint.checkpoint_meta`'s dicts by kind: its role is the one the
        loader is then asked for.
    extra_sources
        Write ``projectors_extra.pt`` (empty when the plan has no extra sources, for a folder whose
        files are fixed); ``False`` for a folder that holds none, as :func:`load_parts`'s.
    """
    from .csa2 import save_adapters
    from .pipeline.paths import MODE_A_SINK
    from .projector import save_bank, save_projector, save_projectors

    models_dir = Path(models_dir)
    if parts.bank is not None:
        save_bank(models_dir / BANK_FILE, parts.bank.cpu(), meta["bank"])
    else:
        save_projector(models_dir / projector_path(plan.source).name, parts.projector.cpu(), meta["projector"])
        if extra_sources:
            save_projectors(models_dir / EXTRA_FILE, {l: p.cpu() for l, p in parts.extra.items()},
                            meta["projectors"])
    save_adapters(models_dir / ADAPTERS_FILE, parts.adapters.cpu(), meta["adapters"])
    if parts.sink is not None:
        save_sink(models_dir / MODE_A_SINK.name, parts.sink.cpu(), meta["sink"])


def load_parts(models_dir: Path | str, params: Params, plan: LayerPlan, geo: Geometry, *, role: Role, device=None,
               dtype=None, extra_sources: bool = True, low_rank: bool = False, bank: bool = False) -> CEDParts:
    """Load the maps of ``plan`` from ``models_dir``, each refused unless it was made for them.

    Parameters
    ----------
    models_dir
        Folder of ``projector_k{s}v{s}.pt``, ``adapters.pt`` and ``projectors_extra.pt``.
    params, plan, geo
        What every file must say it is for (:func:`ced_csa2.pipeline.checkpoint.expected_meta`):
        model name, the layer(s) it maps, ``hidden_size``/``kv_dim`` and the plan.
    role
        The branch every file must belong to (:mod:`ced_csa2.pipeline.map_roles`: ``MAIN`` for
        ``models/``), checked first.
    device, dtype
        Where and in what dtype to build the modules (default: CPU, float32).
    extra_sources
        Load ``projectors_extra.pt`` when the plan has extra sources (Mode A); ``False``
        for a folder that holds none (``tune@<objective>``).
    low_rank
        Also load ``xkv.pt``, the ``xkv`` group's cross-layer bases (stage ``fit_xkv``).
    bank
        Load the projectors as one ``projector_bank.pt`` (Mode A's maps at ``mode_a.train.rank > 0``)
        instead of ``projector_k{s}v{s}.pt`` and ``projectors_extra.pt``.

    Raises
    ------
    CheckpointError
        A file is missing, of another branch, changed after it was written, or was made for
        another model, layer, geometry or plan: one sentence naming the file, the role or key
        and both values, before any weight is used.
    ParamsError
        A file made with other params than ``params`` (its recorded provenance).
    """
    from .csa2 import load_adapters
    from .projector import load_bank, load_projector, load_projectors

    models_dir = Path(models_dir)
    expect = expected_meta(params, plan, geo)
    adapters = load_adapters(models_dir / ADAPTERS_FILE, device=device, dtype=dtype, role=role,
                             expect=expect["adapters"])
    check_meta_provenance(models_dir / ADAPTERS_FILE, adapters.meta, params, role)
    if bank:
        path = models_dir / BANK_FILE
        projectors, meta = load_bank(path, role=role, expect=expect["bank"], device=device, dtype=dtype)
        check_meta_provenance(path, meta, params, role)
        return CEDParts(adapters=adapters, bank=projectors)
    path = models_dir / projector_path(plan.source).name
    projector, meta = load_projector(path, role=role, expect=expect["projector"], device=device, dtype=dtype)
    check_meta_provenance(path, meta, params, role)
    extra = {}
    if plan.extra_sources and extra_sources:
        extra, meta = load_projectors(models_dir / EXTRA_FILE, role=role, expect=expect["projectors"],
                                      device=device, dtype=dtype)
        check_meta_provenance(models_dir / EXTRA_FILE, meta, params, role)
    xkv = None
    if low_rank:
        xkv = load_xkv(models_dir / "xkv.pt", device=device, dtype=dtype, role=role, expect=expect["xkv"])
        check_meta_provenance(models_dir / "xkv.pt", xkv.meta, params, role)
    return CEDParts(projector, adapters, extra, xkv)


def load_mode_a_parts(workdir: Path | str, params: Params, plan: LayerPlan, geo: Geometry, *, device=None) -> CEDParts:
    """The maps Mode A runs with (``mode_a.maps``): the main branch's (``models/``, role ``main``) or
    ``tune_mode_a``'s (``models/mode_a/``, role ``mode_a``), checked as :func:`load_parts` checks them."""
    from .pipeline.paths import MODE_A_MODELS, MODE_A_SINK, MODELS

    if params.mode_a.maps == "main":
        parts = load_parts(Path(workdir) / MODELS, params, plan, geo, role=MAIN, device=device)
    else:
        parts = load_parts(Path(workdir) / MODE_A_MODELS, params, plan, geo, role=MODE_A, device=device,
                           bank=params.mode_a.train.rank > 0)
    if params.mode_a.sink == "mean":
        path = Path(workdir) / MODE_A_SINK
        parts.sink, meta = load_sink(path, expected_meta(params, plan, geo)["sink"], device=device)
        check_meta_provenance(path, meta, params, MODE_A)
    return parts



def load_objective_parts(workdir: Path, name: str, params: Params, plan: LayerPlan, geo: Geometry,
                         device) -> dict[str, CEDParts]:
    """The maps ``tune@<name>`` wrote, per group: ``{group: CEDParts}`` for ``train.eval_groups``.

    The groups that project the source *and* adapt it (``ced_csa2*``) get the pair trained
    for them (``.../ced_csa2/``); the others the ``ced``/``csa2`` pair.  No extra sources
    (Mode B only).  Checked as :func:`ced_csa2.ced_runtime.load_parts` checks the main
    branch's maps (model, layer(s), ``hidden_size``/``kv_dim``, plan), each folder's files as
    the role of its pair (:func:`ced_csa2.pipeline.map_roles.objective`).
    """
    from .config import require_listed

    require_listed(params, name)
    pairs = {pair: load_parts(workdir / objective_pair_models(name, pair), params, plan, geo,
                              role=objective(name, pair), device=device, extra_sources=False) for pair in PAIRS}
    return {g: pairs["ced_csa2" if GROUPS[g].projected_source and GROUPS[g].adapters else "csa2"]
            for g in params.train.eval_groups}


def load_seed_init(workdir: Path, params: Params, plan: LayerPlan, geo: Geometry, device) -> CEDParts:
    """``ced``'s maps under the seed's literal projector recipe (stage ``train_projector``'s reference)."""
    from .projector import load_projector

    path = workdir / projector_path(plan.source, SEED_INIT_MODELS)
    projector, meta = load_projector(path, role=SEED_INIT_ROLE, expect=expected_meta(params, plan, geo)["projector"],
                                     device=device)
    check_meta_provenance(path, meta, params, SEED_INIT_ROLE)  # against the params as that branch applies them
    return CEDParts(projector=projector)


def maps_digest(group: str, parts: CEDParts) -> str:
    """sha256 over the tensors ``group`` reads from ``parts`` (projector and/or adapters), in state-dict order."""
    h = hashlib.sha256(group.encode())
    spec = GROUPS[group]
    for used, module in ((spec.projected_source, parts.projector), (spec.adapters, parts.adapters)):
        if used and module is not None:
            for name, tensor in module.state_dict().items():
                h.update(name.encode())
                h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def parts_for(parts: CEDParts | Mapping[str, CEDParts] | None, group: str) -> CEDParts | None:
    """The maps ``group`` runs with: ``parts`` itself, or ``parts[group]`` for maps per group.

    Per-group maps (``{group: CEDParts}``) let each group be scored with the maps trained
    for it (``tune``'s ``ced_csa2`` pair); a group missing from the mapping gets ``None``.
    """
    return parts.get(group) if isinstance(parts, Mapping) else parts


def require_parts(group: str, parts: CEDParts) -> None:
    """Refuse to run ``group`` without the maps it needs (its registry entry says which)."""
    spec = lookup_group(group)
    if spec.projected_source and parts.projector is None:
        raise ValueError(f"group {group!r} needs a projector")
    if spec.adapters and parts.adapters is None:
        raise ValueError(f"group {group!r} needs adapters")
    if spec.low_rank and parts.xkv is None:
        raise ValueError(f"group {group!r} needs the cross-layer bases of models/xkv.pt (stage fit_xkv)")


class CEDModeBRuntime(GroupRuntime):
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
        the shared store keeps them.  Ignored (pass ``None``) for the other groups.  The
        ``*_fp4_rot`` groups rotate each FP4 entry's streams of
        :data:`ced_csa2.kv.rotation.ROTATED_STREAMS` per head first (``Rᵀ dequant(FP4(R x))``),
        with layer ``l``'s fixed matrix :func:`ced_csa2.kv.rotation.layer_rotation`.  A group with its
        own ``stream_formats`` (``baseline_k6v4_rot``) rounds every attention layer's K and V in those
        (:func:`ced_csa2.kv.formats.group_format`), pre-k_norm and pre-RoPE, exactly as the
        ``kv_formats`` study's round trip does; ``kv_format`` does not apply to it.
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
        if spec.low_rank and tuple(parts.xkv.layers) != (plan.source, *plan.targets):
            raise ValueError(f"group {group!r}: the xkv bases span layers {list(parts.xkv.layers)}, the plan's source "
                             f"and targets are {[plan.source, *plan.targets]}")
        self.model, self.plan, self.group, self.parts, self.spec = model, plan, group, parts, spec
        self.fp4 = FP4_FORMATS[kv_format]() if spec.is_fp4 else None
        # {(layer, "k" | "v"): R} of the rotated FP4 entries; built once here (cheap:
        # head_dim x head_dim per layer), so every forward of this runtime uses the same R.
        self.rotations: dict[tuple[int, str], HeadRotation] = {}
        if spec.rotate:  # rotation.ROTATED_STREAMS read now (stream_rotations), so a study may set it
            geo = geometry(model.config)
            for layer in spec.fp4_layers(geo.attention_layers, plan.source):
                self.rotations.update({(layer, kind): r for kind, r in stream_rotations(geo.head_dim, layer).items()})
        self._stack: ExitStack | None = None
        self._store: dict | None = None

    @property
    def replaced_layers(self) -> tuple[int, ...]:
        """Layers whose K/V this group replaces (or, for FP4 groups, stores quantised)."""
        if self.spec.fp4 == "every_layer" or self.spec.stream_formats is not None:
            return geometry(self.model.config).attention_layers
        return (*self._stored_source, *self._read_targets)

    @property
    def _stored_source(self) -> tuple[int, ...]:
        """The source, when its K/V are replaced by what the store holds (projected, FP4 or xKV)."""
        return (self.plan.source,) if self.spec.projected_source or self.fp4 or self.spec.low_rank else ()

    @property
    def _read_targets(self) -> tuple[int, ...]:
        """Targets that read the stored entry (the source's K/V adapted or verbatim; xKV coefficients)."""
        return self.plan.targets if self.spec.shares_source_kv or self.spec.low_rank else ()

    def _fake_quant(self, x: torch.Tensor, layer: int, kind: str) -> torch.Tensor:
        """What reading layer ``layer``'s ``kind`` (``"k"``/``"v"``) entry ``x`` ``(..., kv_dim)`` back from FP4 gives.

        Quantise, then dequantise; for a rotated entry ``Rᵀ dequant(FP4(R x))``.
        """
        return fp4_round_trip(self.fp4, x, self.rotations.get((layer, kind)))

    def __enter__(self) -> "CEDModeBRuntime":
        if not self.replaced_layers:  # baseline
            return self
        plan, parts, spec = self.plan, self.parts, self.spec
        uses_ced = spec.projected_source
        stack = ExitStack()
        if spec.low_rank:  # xKV: no capture of the modified pass; a clean pass of its own
            self._store = {"k": {}, "v": {}, "h": {}}
            stack.enter_context(kv_hooks.inject(self.model, self._low_rank_replacements(stack, self._store)))
            self._stack = stack
            return self
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
                memo[:] = [raw, self._fake_quant(raw, plan.source, kind) if self.fp4 else raw]
            return memo[1]

        def adapted(layer: int) -> KV:
            src = stored("k"), stored("v")
            key = ("adapted", layer)
            if store.get(key, (None,))[0] is not src[0]:
                store[key] = (src[0], parts.adapt(layer, *src))
            return store[key][1]

        repl: dict = {}
        if spec.stream_formats is not None:  # every attention layer's own K and V in the group's formats
            head_dim = geometry(self.model.config).head_dim
            repl = format_replacements(group_format(spec), self.replaced_layers, head_dim)
        elif spec.fp4 == "every_layer":  # baseline_fp4: every attention layer's own K/V, FP4-rounded
            for layer in self.replaced_layers:
                for kind in "kv":
                    repl[(layer, kind)] = lambda out, layer=layer, kind=kind: self._fake_quant(out, layer, kind)
        else:
            for layer in self._stored_source:
                repl[(layer, "k")] = lambda out: stored("k")
                repl[(layer, "v")] = lambda out: stored("v")
            for t in self._read_targets:
                read = adapted if spec.adapters else (lambda _: (stored("k"), stored("v")))  # share_plain
                repl[(t, "k")] = lambda out, t=t, read=read: read(t)[0]
                repl[(t, "v")] = lambda out, t=t, read=read: read(t)[1]
        stack.enter_context(kv_hooks.inject(self.model, repl))
        if spec.sink:  # entered after the replacements: it restores their first entries
            stack.enter_context(kv_hooks.keep_initial(self.model, self.replaced_layers, spec.sink))
        self._stack = stack
        return self

    def _low_rank_replacements(self, stack: ExitStack, store: dict) -> dict:
        """xKV's replacements: each group layer reads its block of the reconstruction of the *clean* K/V.

        xKV compresses the cache of a finished prefill, which the unmodified model wrote;
        so the reconstruction is of the K/V of a clean pass, not of the (already modified)
        pass the replacements sit in.  A pre-hook on the decoder stack (``model.model``)
        runs that clean pass first, nested, with the replacements inactive, capturing the
        source's and targets' ``k_proj``/``v_proj`` outputs (:func:`kv_hooks.capture`) and
        stopping once the top layer's are in; a forward that starts above the source gets
        them from :meth:`seed` instead (``clean_kv``).  Installs the pre-hook on ``stack``.
        """
        model, basis, group = self.model, self.parts.xkv, self.group
        layers, top = basis.layers, max(basis.layers)
        state = {"clean_pass": False}

        def stop_when_complete(clean: dict):
            def stop(mod, inp, out):
                if top in clean["k"] and top in clean["v"]:
                    raise StopForward  # nothing above the top layer's K/V is needed
            attn = attention(model, top)
            return [attn.k_proj.register_forward_hook(stop), attn.v_proj.register_forward_hook(stop)]

        def clean_pass(module, args, kwargs):
            if state["clean_pass"]:
                return  # the nested call below
            if _cache_argument(module, args, kwargs) is not None:
                raise NotImplementedError(
                    f"group {group!r} compresses the K/V of a finished clean prefill (xKV) and supports "
                    "teacher-forced passes only, not a forward with a KV cache (cached generation)")
            state["clean_pass"] = True
            try:
                with torch.no_grad(), kv_hooks.capture(model, layers) as clean, \
                        kv_hooks.installed(lambda: stop_when_complete(clean)):
                    try:
                        module(*args, **kwargs)  # the same call, so the same K/V as a plain forward
                    except StopForward:
                        pass
            finally:
                state["clean_pass"] = False
            store["clean"] = clean

        def read(layer: int) -> KV:
            clean = store.get("clean")
            if clean is None:
                raise RuntimeError(f"group {group!r} reads the reconstruction of the clean K/V, and none was "
                                   "captured: call the model inside the runtime, or seed(clean_kv=...)")
            if store.get("recon_of") is not clean:  # once per forward, shared by every layer of the group
                store["recon_of"], store["recon"] = clean, basis(clean["k"], clean["v"])
            return store["recon"][layer]

        stack.enter_context(kv_hooks.installed(
            lambda: [model.model.register_forward_pre_hook(clean_pass, with_kwargs=True)]))
        repl = {}
        for layer in layers:
            repl[(layer, "k")] = lambda out, layer=layer: out if state["clean_pass"] else read(layer)[0]
            repl[(layer, "v")] = lambda out, layer=layer: out if state["clean_pass"] else read(layer)[1]
        return repl

    def seed(self, *, h_split: torch.Tensor | None = None, source_kv: KV | None = None,
             clean_kv: Mapping[int, KV] | None = None) -> None:
        """Hand the hooks what they capture (``H_split``, the true source K/V) from a pass they did not see.

        For a forward that starts above ``plan.split`` (or ``plan.source``) from a hidden
        state a shared trunk computed (:func:`ced_csa2.eval.scoring.multi_group_nll`): the
        capture hooks of the skipped layers never fire, so the trunk's tensors stand in
        for them -- exactly what they would have recorded.  ``clean_kv`` (``xkv``): the
        clean ``{layer: (K, V)}`` of the source and every target, each ``(B, T, kv_dim)``,
        which the nested clean pass would have captured.  Call inside the context, before
        the forward; a no-op for ``baseline`` (no hooks).
        """
        if self._store is None:
            return
        if h_split is not None:
            self._store["h"][self.plan.split] = h_split
        if source_kv is not None:
            self._store["k"][self.plan.source], self._store["v"][self.plan.source] = source_kv
        if clean_kv is not None:
            self._store["clean"] = {"k": {l: kv[0] for l, kv in clean_kv.items()},
                                    "v": {l: kv[1] for l, kv in clean_kv.items()}}

    def __exit__(self, *exc) -> None:
        self._store = None
        if self._stack is not None:
            self._stack.close()
            self._stack = None


class StopForward(Exception):
    """Raised by a hook to end a forward pass early (after the split layer; xKV's clean pass)."""


def _cache_argument(module: nn.Module, args: tuple, kwargs: dict):
    """The KV cache a decoder-stack call was given (``cache`` / ``past_key_values``), or ``None``."""
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
    except TypeError:
        bound = dict(kwargs)
    extra = bound.get("kwargs") or {}
    found = [bound.get(name, extra.get(name)) for name in ("cache", "past_key_values")]
    return next((c for c in found if c is not None), None)


@torch.inference_mode()
def prompt_tokens(length: int, fraction: float) -> int:
    """Tokens of a ``length``-token record that Mode A takes as the prompt: the first ``fraction``, at least 2.

    The prompt's last token is fed with the continuation (it predicts the first scored token), so the
    skip prefills ``prompt_tokens(...) - 1`` tokens.
    """
    return max(2, int(length * fraction))


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


@torch.inference_mode()
def continue_hidden(model: nn.Module, cache, prompt_ids: torch.Tensor, continuation_ids: torch.Tensor) -> torch.Tensor:
    """:func:`continue_from` without the LM head: the final hidden states ``(B, C, hidden)`` (after
    the final norm) that predict ``continuation_ids`` ``(B, C)``, for :func:`ced_csa2.eval.scoring.score_hidden`."""
    x = torch.cat([prompt_ids[:, -1:], continuation_ids[:, :-1]], dim=1)
    return model.model(input_ids=x, cache=cache, use_cache=True).last_hidden_state


SINKS = ("none", "exact", "mean")  # what Mode A's first position holds above the cut (CEDModeARuntime)


class CEDModeARuntime:
    """Prefill skip: prompt through layers ``1..split``, K/V above the cut from the maps.

    The plan must cover every attention layer above the cut (refused otherwise, naming
    the uncovered layers).  Non-attention layers above the cut start from a zero state.

    ``sink`` says what the first position (the attention sink, StreamingLLM's term: the entry
    most heads attend to when nothing else matches) holds above the cut: ``"none"`` the maps'
    K/V like every position (the seed's pure skip); ``"exact"`` its own, the first token run
    through every layer first (a one-token forward: it reads every weight of the layers above
    the cut once); ``"mean"`` the constants of ``parts.sink`` (:class:`SinkKV`, no compute).
    The first token's hidden state carries the model's massive activations, which no map of
    the other positions reproduces (the embedded default: ``docs/results.md``, "Mode A").

    With ``replay = r > 0`` (bounded replay, as DeepSeek-V4.1 serves its compressed
    prefixes) the last ``r`` prefilled tokens also run through the layers above the cut:
    they get their own K/V there (attending to the mapped K/V of the older positions) and
    a non-attention layer's state is built from them (and the sink's) instead of staying
    zero.  An exact sink plus ``r`` at least the prefilled length is the plain prefill.

    Parameters
    ----------
    model, plan, parts
        As for :class:`CEDModeBRuntime`; ``parts.extra`` holds the extra sources.
    geo
        The model's geometry (for the covering check).
    replay
        Prefilled tokens (the last ones) that also run through the layers above the cut.
    sink
        ``"none"``, ``"exact"`` or ``"mean"``: the first position's K/V above the cut.
    """

    def __init__(self, model: nn.Module, plan: LayerPlan, geo: Geometry, parts: CEDParts, *, replay: int = 0,
                 sink: str = "none"):
        plan.require_covering(geo)
        if replay < 0:
            raise ValueError(f"CEDModeARuntime: replay must be >= 0 tokens, got {replay}")
        if sink not in SINKS:
            raise ValueError(f"CEDModeARuntime: sink must be one of {list(SINKS)}, got {sink!r}")
        if sink == "mean" and parts.sink is None:
            raise ValueError("CEDModeARuntime: sink='mean' reads the sink's constants from parts.sink, which is None "
                             "(stage tune_mode_a writes them)")
        self.model, self.plan, self.geo, self.parts = model, plan, geo, parts
        self.replay, self.sink = replay, sink

    @property
    def exact_tokens(self) -> int:
        """Prompt tokens that run through every layer before the skip: the exact sink's one, or none."""
        return int(self.sink == "exact")

    def predicted_kv(self, h: torch.Tensor) -> dict[int, KV]:
        """``{layer: (K, V)}`` for every covered layer, from ``H_split`` ``(B, T, hidden)``."""
        plan = self.plan
        out = self.parts.project_all(plan, h)
        for t in plan.targets:
            out[t] = self.parts.adapt(t, *out[plan.source])
        return out

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor):
        """Cache for ``input_ids`` ``(B, T)`` (no padding) built with the prefill skip (and its replay)."""
        return self.prefill_with_grad(input_ids)

    def prefill_with_grad(self, input_ids: torch.Tensor):
        """:meth:`prefill` under the caller's autograd mode: the mapped K/V carry the maps' gradients.

        Layers ``1..split`` and the sink run without autograd (neither depends on the maps); the
        mapped entries and the replayed tail (which attends to them) keep their graph, for a
        loss on the continuation that trains the maps (``tune@mode_a``).
        """
        from transformers import DynamicCache

        model = self.model
        cache = DynamicCache(config=model.config)
        length = input_ids.shape[1]
        sink = min(self.exact_tokens, length)
        end = max(sink, length - self.replay)  # mapped positions: [sink, end)
        if sink:  # the exact sink: every layer
            with torch.no_grad():
                model.model(input_ids=input_ids[:, :sink], cache=cache, use_cache=True)
        if end > sink:
            self._skip(input_ids[:, sink:end], cache, start=sink)
        if end < length:  # the replayed tail: every layer, after the mapped positions
            model.model(input_ids=input_ids[:, end:], cache=cache, use_cache=True)
        return cache

    def split_hidden(self, input_ids: torch.Tensor, cache=None) -> torch.Tensor:
        """``H_split`` ``(B, T, hidden)`` of ``input_ids`` ``(B, T)``: layers ``1..split`` only (into ``cache``, if given)."""
        h_split = {}

        def stop(mod, inp, out):
            h_split["h"] = out[0] if isinstance(out, tuple) else out
            raise StopForward

        handle = decoder_layer(self.model, self.plan.split).register_forward_hook(stop)
        try:
            with torch.no_grad():
                self.model.model(input_ids=input_ids, cache=cache, use_cache=cache is not None)
        except StopForward:
            pass
        finally:
            handle.remove()
        return h_split["h"]

    def _skip(self, input_ids: torch.Tensor, cache, start: int = 0) -> None:
        """Layers ``1..split`` on ``input_ids`` into ``cache``; the covered layers above get the mapped K/V.

        ``start``: the position of ``input_ids``' first token (the tokens ``cache`` already holds).
        """
        model = self.model
        h = self.split_hidden(input_ids, cache)
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        positions = positions.expand(input_ids.shape[0], -1)
        kv = self.predicted_kv(h)
        layers = sorted(kv)
        # Every covered layer at once, (B, T, L, kv_dim): at prompt lengths a per-layer RoPE
        # and sink splice cost more in dispatch than in arithmetic (the same elementwise
        # operations, so the same bits).
        k, v = (torch.stack([kv[layer][i] for layer in layers], 2) for i in (0, 1))
        if self.sink == "mean" and start == 0:
            k[:, 0], v[:, 0] = self.parts.sink.stacked(layers)
        batch, length = k.shape[:2]
        head_dim = attention(model, layers[0]).head_dim
        k, v = k.view(batch, length, len(layers), -1, head_dim), v.view(batch, length, len(layers), -1, head_dim)
        norms = [getattr(attention(model, layer), "k_norm", None) for layer in layers]  # each its own weights
        if any(n is not None for n in norms):
            k = torch.stack([k[:, :, i] if n is None else n(k[:, :, i]) for i, n in enumerate(norms)], 2)
        by_kind = {}  # Gemma-3 rotates sliding and full layers with different theta
        for i, layer in enumerate(layers):
            by_kind.setdefault(layer_type(model.config, layer), []).append(i)
        for idx in by_kind.values():
            first = layers[idx[0]]
            keys = k if len(idx) == len(layers) else k[:, :, idx]
            keys = keys.flatten(2, 3).transpose(1, 2)  # (B, n·heads, T, head_dim)
            # The model's function rotates a query and a key; one head stands in for the query (dropped).
            _, keys = rope_fn(attention(model, first))(keys[:, :1], keys, *rotary(model, first, h, positions))
            keys = keys.unflatten(1, (len(idx), -1))  # (B, n, heads, T, head_dim)
            for j, i in enumerate(idx):
                # The cache layer keeps what its kind keeps (a sliding-window layer: the last window - 1).
                cache.update(keys[:, j], v[:, :, i].transpose(1, 2), layers[i] - 1)

    def continue_above_cut(self, cache, input_ids: torch.Tensor, h_split: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``(B, C, hidden)`` (after the final norm) of ``input_ids`` ``(B, C)`` continuing ``cache``.

        ``cache`` holds the skip-prefilled prompt (:meth:`prefill_with_grad`, no replay; the sink's
        entries exact);
        ``h_split`` ``(B, C, hidden)`` is ``H_split`` at the continuation's positions.  Below the
        cut Mode A's continuation *is* the plain model's (those layers read the prompt's true
        cache), so the plain model's pass over the whole record gives ``h_split`` exactly and
        only the layers above the cut run here, under the caller's autograd mode -- what
        :func:`ced_csa2.train.objectives.mode_a_kl` trains through.  The model's own forward
        runs on ``input_ids`` only until each kind of layer above the cut has been handed its
        arguments (:func:`~ced_csa2.kv_hooks.layer_calls`: this cache's masks and positions);
        the layers it passes on the way write the continuation into their part of ``cache``,
        which nothing above the cut reads (the cache is the caller's to drop).  A model whose
        layer kinds above the cut first appear above it runs the whole forward instead.
        """
        first, n = self.plan.split + 1, self.geo.n_layers
        stop = kv_hooks.kinds_seen_by(self.model, range(first, n + 1))
        if stop > first:
            return self.model.model(input_ids=input_ids, cache=cache, use_cache=True).last_hidden_state
        with kv_hooks.layer_calls(self.model, stop) as calls:
            try:
                self.model.model(input_ids=input_ids, cache=cache, use_cache=True)
            except kv_hooks.StopLayers:
                pass
        return kv_hooks.run_layers(self.model, h_split, first, calls, fresh_cache=False)

    @torch.inference_mode()
    def continuation_logits(self, prompt_ids: torch.Tensor, continuation_ids: torch.Tensor) -> torch.Tensor:
        """Logits predicting ``continuation_ids`` ``(B, C)`` given a skip-prefilled prompt.

        The prompt's last token runs through all layers (it makes the first prediction),
        so the skip covers ``prompt_ids[:, :-1]``.  Returns ``(B, C, vocab)``.
        """
        return continue_from(self.model, self.prefill(prompt_ids[:, :-1]), prompt_ids, continuation_ids)

    def continuation_hidden(self, prompt_ids: torch.Tensor, continuation_ids: torch.Tensor) -> torch.Tensor:
        """:meth:`continuation_logits` without the LM head: final hidden states ``(B, C, hidden)``."""
        return continue_hidden(self.model, self.prefill(prompt_ids[:, :-1]), prompt_ids, continuation_ids)

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
