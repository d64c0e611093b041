"""How far retrofitted adapters push cross-layer sharing: k Full layers above the cut, every other layer a reader.

    dvc repro studies/dvc.yaml:sharing_part@1  # runs: python studies/sharing.py --k 1 (one part per k)
    dvc repro studies/dvc.yaml:sharing         # every part not yet run, then: python studies/sharing.py

The default plan shares 4 of the embedded model's 30 attention layers (source 18, readers
22/26/30): the cache shrinks by 10% and rotated FP4 on every layer is the whole Pareto front.
V4.1 instead keeps a few *Full* layers and lets every other global layer reuse one of them.
Here ``k`` Full layers (``full_layers``, each ``k`` an arm family) are evenly spaced from the first
attention layer above the cut (:func:`ced_csa2.runtime.sub_plans.spaced_full_layers`: SmolLM2,
cut after 15: 16 | 16, 23 | 16, 21, 26 | 16, 19, 23, 27) and each serves the attention layers
above it up to the next -- ``k`` single-source sub-plans over disjoint layers, scored as
:class:`~ced_csa2.runtime.sub_plans.NestedRuntimes` of the pipeline's own Mode B runtimes.
Even spacing, not a greedy choice by held-out fit: it is fixed before any data is seen (no
selection to over-fit on 32 eval records), it is V4.1's own layout (Full layers every 6th), and
it makes the furthest reader as near its Full layer as ``k`` allows (the adapters' fit falls
with distance: the held-out R² below).

Maps, one arm family per objective (``objectives``): the ``ridge`` objective's
(:func:`~ced_csa2.train.tuning.ridge_served`: ridge-initialised adapters of ``train_adapters``' form,
MLPs at their zero start), fitted on the ridge stage's train records of the study's own dump of
``prepare``'s training records (the ``dump`` stage, once per part, in a scratch folder, so the study reads
nothing made on another CPU; it holds every attention layer above the cut on the embedded default: its
plan covers them for Mode A), all of a part's sub-plans in one streaming pass (:func:`~ced_csa2.maps.ridge.fit_maps`;
a map from one source to one reader is the same map in every ``k``).  ``ced_csa2`` also projects
every Full layer from ``H_split`` (its ridge projector).  ``attn_out`` / ``distill``: each sub-plan's
maps trained from those ridge maps by the pipeline's own ``tune@<objective>`` branch
(:func:`~ced_csa2.train.tuning.train_branch`, ``train.online``'s budget and records) through the
phases the arms serve -- ``csa2`` (the readers' adapters, true source K/V) and, for a ``ced_csa2``
arm, ``ced_csa2`` (its own projector and adapters jointly) -- each objective on its own ``k`` (``trained``;
rows ``k{k}/<arm>@<objective>``, beside the ridge rows): ``attn_out`` and ``distill`` (a pass to the final hidden
state per step) on every ``k``.
Each sub-plan is trained alone, as the pipeline trains its one plan: under ``distill`` the other sub-plans'
layers keep their true K/V (``attn_out`` re-runs each reader's attention on its true input whatever the other
layers do).

Arms (``arms``): the groups nested, outermost first: a sharing group run by every sub-plan
(``csa2``: sharing alone; ``csa2_fp4_rot``: the Full layers' stored entries in rotated FP4, every
other layer dense; ``ced_csa2``), optionally inside an every-layer FP4 group (``baseline_fp4``,
``baseline_fp4_rot``: every stored copy in FP4, the readers storing nothing).  Scored with the
pipeline's ``pipeline_groups`` (the plan's own groups; those with maps at the ``ridge`` objective's,
the ``ridge`` stage run on the study's dump, like every arm here; ``xkv`` at the ``fit_xkv`` stage's bases on
that dump) in one :func:`~ced_csa2.eval.perplexity.groups_ppl`
call -- one baseline, paired bootstrap 95% intervals over the same records -- on the held-out
records of ``data/corpus/eval.jsonl`` (``eval_ppl.records``), then once per other domain (``data.domains``:
``eval_ppl.domain_records`` seeded records of each, the records and scorer of eval_ppl's domain panel), every
row carrying its worst other domain's ΔPPL as the pipeline's headline groups do.  Bytes per token (bf16, as the
report's frontier) on both bases (:func:`~ced_csa2.runtime.sub_plans.nested_copies`), adapter and
projector parameters apart.

Generation through the real cache (``generation``): every row also greedily continues the pipeline's
``eval_generation`` prompts (the same seeded held-out records' first ``prompt_tokens`` tokens,
``new_tokens`` tokens, all prompts in one batch) through the cache that holds its bytes -- an arm's
:class:`~ced_csa2.runtime.sub_plans.SubPlansSharedKVCache` (one store per Full layer, FP4 and rotated
as its group stores its source, the readers nothing), a pipeline row's own cache
(:func:`~ced_csa2.eval.generation.run_groups`) -- its used bytes checked against the arm's accounting
to the byte, and is compared with the baseline's continuation as ``eval_generation`` compares
(:func:`~ced_csa2.eval.generation.generation_rows`: agreement by position, the plain model's NLL per
token of the continuation minus the baseline's, paired bootstrap 95% intervals over prompts).  An
arm with an every-layer FP4 group around its sub-plans has none (``–``): no cache composes the two.

One part per ``k`` (``--k``: its own dump, maps, baseline and scoring, so that the study can run a part at
a time, each its own lock entry) writes ``studies/sharing/parts/k<k>/part.json`` and its wall time to
``timings/study_sharing_k<k>.json``; without ``--k`` the parts of every ``full_layers`` entry are combined
into ``studies/sharing/sharing.tsv`` (one row per arm), ``sharing.md`` (the table, the Pareto fronts and
the byte budgets at which sharing beats FP4 alone) and ``frontier.png``.  Params:
``studies/sharing.yaml`` and ``params.yaml``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import nn

from ced_csa2.ced_runtime import CEDModeBRuntime, CEDParts
from ced_csa2.config import TUNE_OBJECTIVES, Params, PlanConfig, check_provenance, from_dict, load_params, \
    provenance, to_dict
from ced_csa2.csa2 import mlp_width
from ced_csa2.data.dump_file import DumpReader
from ced_csa2.data.records import check_prepared, read_records
from ced_csa2.data.loader import aligned_block_rows, record_split, row_mask
from ced_csa2.eval import generation as gen
from ced_csa2.eval.perplexity import EVAL_SAMPLE_STREAM, eval_ids, groups_ppl
from ced_csa2.eval.results import frontier
from ced_csa2.kv.formats import FP4_FORMATS
from ced_csa2.kv.kv_bytes import BASES, DTYPE_BYTES, StoredCopy, adapter_params_per_target, bytes_per_token, \
    kv_copies, projector_params
from ced_csa2.maps.ridge import MapGroup, adapter_map, evaluate_maps, fit_maps, map_groups, save_ridge
from ced_csa2.maps.xkv import load_xkv
from ced_csa2.model_utils import Geometry, load_model_and_tokenizer, resolve_device
from ced_csa2.pipeline.atomic_files import atomic_write_text, write_json, write_tsv
from ced_csa2.pipeline.checkpoint import SAVE_DTYPE, check_meta_provenance, expected_meta
from ced_csa2.pipeline.map_roles import MAIN
from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.figures import write_png
from ced_csa2.pipeline.progress import Progress
from ced_csa2.pipeline.paths import DUMP_PATH, EVAL_JSONL, RIDGE_PATH, TIMINGS, TRAIN_JSONL, XKV_PATH, domain_jsonl
from ced_csa2.pipeline.scratch import copy_prepared
from ced_csa2.pipeline.study_runner import run_study
from ced_csa2.plan import LayerPlan, load_plan
from ced_csa2.groups import GROUPS
from ced_csa2.runtime.shared_kv import cache_bytes
from ced_csa2.runtime.sub_plans import NestedRuntimes, SubPlansSharedKVCache, nested_copies, spaced_full_layers, \
    sub_plans
from ced_csa2.stages import dump, fit_xkv, ridge
from ced_csa2.train.adapter_training import adapter_heads, adapter_optimizer, load_pairs
from ced_csa2.train.objectives import PHASE_GROUPS
from ced_csa2.train.projector_training import train_projectors
from ced_csa2.train.training import TensorBatches, build_adapters, fit, split_masks
from ced_csa2.train.tuning import new_teachers, ridge_served, train_branch

STUDY_PARAMS = Path("studies/sharing.yaml")
OUT = Path("studies/sharing")
BYTES = "bf16"  # the dtype the bytes are counted in: the report's frontier's
FP4_ALONE = ("baseline_fp4", "baseline_fp4_rot")  # what sharing must beat
SEED_RECIPE = "kv_mse"  # the pipeline's main branch (train_adapters, train_projector), as eval_objectives names it
TRAINED = (SEED_RECIPE, *TUNE_OBJECTIVES[1:])  # what trains the ridge maps: the seed's recipe, the tune objectives
log = logging.getLogger("sharing")


@dataclass(frozen=True)
class Training:
    objective: str  # of TRAINED: the seed's recipe on the dump's K/V, or a tune objective through the model
    full_layers: list[int]  # the k (of the study's full_layers) whose maps it trains


@dataclass(frozen=True)
class Study:
    full_layers: list[int]  # k: one arm family per entry
    arms: list[list[str]]  # groups nested, outermost first: [every-layer FP4 group,] sharing group
    pipeline_groups: list[str]  # the pipeline's own groups, scored beside (baseline among them)
    trained: list[Training]  # the objectives that train the ridge maps (the ridge rows are always there)

    @property
    def objectives(self) -> list[str]:
        """``ridge`` (the maps untrained), then each training objective."""
        return ["ridge", *(t.objective for t in self.trained)]

    def trains(self, objective: str, k: int) -> bool:
        """Whether the study has a row of ``k``'s maps at ``objective`` (every ``k`` has its ridge rows)."""
        return objective == "ridge" or any(t.objective == objective and k in t.full_layers for t in self.trained)


def load_study(path: Path = STUDY_PARAMS) -> Study:
    """The study's params, typed and checked, each failure one line naming the file and key."""
    study = from_dict(Study, yaml.safe_load(path.read_text()))
    if not study.full_layers or not study.arms:  # from_dict has refused a count or an arm listed twice
        raise ValueError(f"{path}: full_layers and arms must each list at least one entry")
    for arm in study.arms:
        known = [g for g in arm if g in GROUPS]
        if known != arm or not 1 <= len(arm) <= 2 or not GROUPS[arm[-1]].shares_source_kv or any(
                GROUPS[g].fp4 != "every_layer" for g in arm[:-1]) or (len(arm) == 2 and GROUPS[arm[-1]].is_fp4):
            raise ValueError(f"{path}: arms entry {arm}: give a sharing group without FP4 of its own after at most "
                             f"one every-layer FP4 group (baseline_fp4, baseline_fp4_rot), or a sharing group alone")
    for i, t in enumerate(study.trained):
        if t.objective not in TRAINED or study.objectives.index(t.objective) != i + 1:
            raise ValueError(f"{path}: trained.{i}.objective must be one of {list(TRAINED)}, each "
                             f"once (ridge: the untrained maps, always scored); got {t.objective!r}")
        if not t.full_layers or not set(t.full_layers) <= set(study.full_layers):
            raise ValueError(f"{path}: trained.{i}.full_layers {t.full_layers} must be some of full_layers "
                             f"{study.full_layers}")
    if "baseline" not in study.pipeline_groups or not set(study.pipeline_groups) <= set(GROUPS):
        raise ValueError(f"{path}: pipeline_groups must be known groups, baseline among them; got "
                         f"{study.pipeline_groups}")
    return study


def arm_name(k: int, arm: list[str], objective: str = "ridge") -> str:
    """``k{k}/<groups>``, ``@<objective>`` for maps trained from the ridge ones (ridge rows keep their names)."""
    return f"k{k}/{'+'.join(arm)}" + ("" if objective == "ridge" else f"@{objective}")


def pipeline_name(group: str) -> str:
    """A pipeline group's row: ``pipeline:<group>``, ``@ridge`` where it runs maps (the ridge objective's)."""
    return f"pipeline:{group}" + ("@ridge" if GROUPS[group].uses_maps else "")


def study_plans(geo: Geometry, split: int, study: Study) -> dict[int, list[LayerPlan]]:
    """``{k: sub-plans}`` (refuses a ``k`` that leaves a Full layer without readers)."""
    return {k: sub_plans(geo, split, spaced_full_layers(geo, split, k)) for k in study.full_layers}


def fit_sub_plans(params: Params, plans: list[LayerPlan], geo: Geometry, workdir: Path, scratch: Path
                  ) -> tuple[dict, dict]:
    """Ridge maps of every sub-plan, one streaming pass over ``workdir``'s dump, as the ridge stage fits them.

    Returns ``({plan: {"csa2" | "ced_csa2": CEDParts}}, {plan: mean held-out R² of its readers' K/V maps})``.
    Each sub-plan's maps are written to ``scratch`` as a ridge file made for its own params (the
    root's, with that plan), which :func:`~ced_csa2.train.tuning.ridge_served` reads back.
    """
    plan0 = plans[0]
    served: dict[int, set[int]] = {}
    for p in plans:
        served.setdefault(p.source, set()).update(p.targets)
    by_source = {s: LayerPlan(plan0.split, s, tuple(sorted(t))) for s, t in served.items()}
    # One input, one Gram matrix: the projectors share H_split's; each Full layer's readers share its K/V's.
    groups = [MapGroup("h_split", {f"proj_{s}": (f"k_{s}", f"v_{s}") for s in by_source})]
    groups += [MapGroup(g.x, {f"{name}@{s}": ys for name, ys in g.maps.items()})
               for s, p in by_source.items() for g in map_groups(p)[1:]]
    with DumpReader(workdir / DUMP_PATH) as reader:
        reader.check(kv_layers={la for p in plans for la in p.kv_layers})
        check_provenance(reader.path, reader.provenance(), params)
        train, val = record_split(reader.n_records, params.split.val_fraction, params.seed)
        train_mask = row_mask(reader.record_offsets, train, 0, params.seed)
        val_mask = row_mask(reader.record_offsets, val, 0, params.seed)
        block_rows = aligned_block_rows(reader, params.ridge.block_rows)
        log.info("ridge maps of %d sub-plans (Full layers %s) on %d train records", len(plans), sorted(by_source),
                 len(train))
        maps = fit_maps(reader, groups, train_mask, block_rows, params.ridge.lam)
        fits = evaluate_maps(reader, groups, maps, val_mask, block_rows)
    parts, r2 = {}, {}
    for p in plans:
        params_p = sub_plan_params(params, p)
        names = [n for g in map_groups(p) for n in g.maps]
        own = {n: maps[n if n.startswith("proj_") else f"{n}@{p.source}"] for n in names}
        folder = sub_plan_folder(scratch, p)
        save_ridge(folder / RIDGE_PATH, own, {"plan": to_dict(params_p.plan),
                                              "provenance": provenance(params_p, *ridge.PROVENANCE)})
        parts[p] = ridge_served(params_p, p, geo, folder)
        read = [f"{adapter_map(kind, t, params.train_adapters.input)}@{p.source}" for t in p.targets for kind in "kv"]
        r2[p] = sum(fits[n]["r2"] for n in read) / len(read)
    return parts, r2


def sub_plan_folder(scratch: Path, plan: LayerPlan) -> Path:
    """A sub-plan's folder under ``scratch``: its ridge file (:func:`fit_sub_plans`), and its seed-recipe maps."""
    return scratch / f"s{plan.source}_t{plan.targets[0]}-{plan.targets[-1]}"


def train_seed_recipe(params: Params, plans: list[LayerPlan], geo: Geometry, workdir: Path, scratch: Path) -> dict:
    """Each sub-plan's maps trained by the seed's K/V-MSE recipe (``kv_mse``), the pipeline's main branch: the
    adapters as stage ``train_adapters`` trains them (SGD from the ridge maps on the dump's sampled K/V pairs), the
    projector as stage ``train_projector`` (AdamW), on ``workdir``'s dump, from each sub-plan's ridge file of
    :func:`fit_sub_plans` (under ``scratch``).

    The stages themselves cannot run here: the dump's record names the root plan, which each refuses for another;
    so the rows are masked under the root params (the same records and rows) and the rest runs under the sub-plan's.
    The maps are rounded to the files' precision (:data:`~ced_csa2.pipeline.checkpoint.SAVE_DTYPE`) as the main
    branch's are: on the root plan itself they are its maps, figure for figure (``tests/studies``).
    Returns ``{plan: {"csa2" | "ced_csa2": CEDParts}}``: like the pipeline's ``ced_csa2`` under ``kv_mse``, both
    pairs run the same maps (the projector, and the adapters trained on the true source).
    """
    dump, kv, cfg, device = workdir / DUMP_PATH, geo.kv_dim, params.train_adapters, resolve_device("auto")
    trained = {}
    for p in plans:
        params_p, ridge_file = sub_plan_params(params, p), sub_plan_folder(scratch, p) / RIDGE_PATH
        log.info("kv_mse: Full layer %d, readers %s", p.source, list(p.targets))
        train_mask, val_mask = split_masks(dump, params, p, geo, p.kv_layers, params.split.tokens_per_record)
        adapters = build_adapters(params_p, p, kv, ridge_file).to(device)
        train = TensorBatches(*load_pairs(dump, p, train_mask, kv), cfg.batch_size, shuffle=True, seed=params.seed)
        val = TensorBatches(*load_pairs(dump, p, val_mask, kv), cfg.batch_size, shuffle=False, seed=params.seed)
        fit(adapter_heads(adapters, kv), adapter_optimizer(adapters, params), train, val, epochs=cfg.epochs,
            device=device, amp_dtype=cfg.amp_dtype, keep=cfg.keep, desc=f"kv_mse adapters of {p.source}")
        masks = split_masks(dump, params, p, geo, [p.source], tokens_per_record=0)
        projector = train_projectors(params_p, dump, (p.source,), geo, *masks, desc=f"kv_mse projector {p.source}",
                                     ridge=ridge_file).projectors[p.source]
        # in the precision the main branch's files hold them (what its groups run)
        served = CEDParts(*(m.cpu().eval().to(SAVE_DTYPE).float() for m in (projector, adapters)))
        trained[p] = {"csa2": served, "ced_csa2": served}
    return trained


def train_sub_plans(objective: str, params: Params, plans: list[LayerPlan], ridge_parts: dict, groups: set[str],
                    model, tok, workdir: Path) -> dict:
    """Each sub-plan's maps trained by ``objective`` from copies of its ridge ones (``ridge_parts`` stays as it is).

    Returns ``{plan: {"csa2" | "ced_csa2": CEDParts}}``, the maps of
    :func:`fit_sub_plans` trained through the phases of ``groups`` (the sharing groups the arms run:
    ``csa2``'s adapters, and ``ced_csa2``'s pair where a group projects its source), one
    :func:`~ced_csa2.train.tuning.train_branch` per sub-plan with the pipeline's ``train.online`` budget.
    The frozen model's teacher passes are made once for all sub-plans (they read the same records): for the
    plan whose source is the lowest Full layer and whose targets are every other layer of ``plans``.
    """
    phases = tuple(g for g in PHASE_GROUPS[1:] if g in {map_pair(x) for x in groups})
    first = min(p.source for p in plans)
    union = LayerPlan(plans[0].split, first, tuple(sorted({la for p in plans for la in p.kv_layers} - {first})))
    teachers = new_teachers(objective, model, union)
    trained = {}
    for p in plans:
        served = copy.deepcopy(ridge_parts[p])
        summaries, _, _ = train_branch(objective, sub_plan_params(params, p), p, served, model, tok, workdir,
                                       phases=phases, teachers=teachers)
        for group, summary in summaries.items():
            log.info("%s, Full layer %d, readers %s: %s phase held-out loss %.5f -> %.5f", objective, p.source,
                     list(p.targets), group, summary["val_before"]["loss"], summary["val_after"]["loss"])
        trained[p] = served
    return trained


def map_pair(group: str) -> str:
    """The maps a sharing group runs: ``ced_csa2``'s pair where it projects its source, else ``csa2``'s."""
    return "ced_csa2" if GROUPS[group].projected_source else "csa2"


def sub_plan_params(params: Params, plan: LayerPlan) -> Params:
    """``params`` with ``plan`` as its layer plan (what that sub-plan's ridge file is made for)."""
    cfg = PlanConfig(f"{params.plan.name}:s{plan.source}", plan.split, plan.source, list(plan.targets), [])
    return dataclasses.replace(params, plan=cfg)


def arm_runtime(model, arm: list[str], plans: list[LayerPlan], parts: dict, kv_format: str) -> NestedRuntimes:
    """The arm's runtimes nested: its every-layer FP4 group outside, its sharing group once per sub-plan."""
    *outer, group = arm
    pair = map_pair(group)
    return NestedRuntimes([CEDModeBRuntime(model, plans[0], g, kv_format=kv_format) for g in outer]
                          + [CEDModeBRuntime(model, p, group, parts[p][pair], kv_format=kv_format) for p in plans])


def arm_copies(geo: Geometry, arm: list[str], plans: list[LayerPlan], basis: str, dtype_bytes: int,
               fp4_group: int) -> list[StoredCopy]:
    """The copies the arm's caches keep on ``basis``, a dense element ``dtype_bytes`` bytes."""
    *outer, group = arm
    return nested_copies([kv_copies(geo, plans[0], GROUPS[g], basis, dtype_bytes, fp4_group) for g in outer]
                         + [kv_copies(geo, p, GROUPS[group], basis, dtype_bytes, fp4_group) for p in plans])


def arm_bytes(geo: Geometry, arm: list[str], plans: list[LayerPlan], basis: str, fp4_group: int) -> float:
    """Bytes per token (:data:`BYTES`) of the arm's caches on ``basis``."""
    return bytes_per_token(arm_copies(geo, arm, plans, basis, DTYPE_BYTES[BYTES], fp4_group))


def arm_generation(model: nn.Module, geo: Geometry, name: str, arm: list[str], plans: list[LayerPlan], parts: dict,
                   prompts: torch.Tensor, new_tokens: int, kv_format: str, fp4_group: int
                   ) -> gen.GroupGeneration | None:
    """The arm's greedy continuation of ``prompts`` ``(B, T)``, ``new_tokens`` tokens, through the cache that holds its
    bytes, or ``None`` for an arm with an every-layer FP4 group around its sub-plans (no cache composes the two).

    One :class:`~ced_csa2.runtime.sub_plans.SubPlansSharedKVCache`: each Full layer's store holds its K/V as the
    arm's group stores its source (dense, or FP4 in ``kv_format``, rotated for a ``*_rot`` group), its readers
    nothing.  Its used bytes after the last step must be the arm's accounting on the ``all_attention`` basis in the
    model's dtype, to the byte (:func:`~ced_csa2.eval.generation.check_bytes`: one line naming the arm otherwise).
    """
    if len(arm) > 1:
        return None
    spec = GROUPS[arm[0]]
    pair = map_pair(arm[0])  # the dense twin: the store's group and the maps it runs
    storage = kv_format if spec.is_fp4 else "bf16"
    cache = SubPlansSharedKVCache(model, plans, pair, {p: parts[p][pair] for p in plans}, storage, rotate=spec.rotate)
    decoder = gen.StepDecoder(model, cache, cache.feed)
    decoder.prefill(prompts)
    for _ in range(new_tokens - 1):
        decoder.step()
    positions = cache.get_seq_length()
    accounted = round(len(prompts) * positions * bytes_per_token(
        arm_copies(geo, arm, plans, "all_attention", model.dtype.itemsize, fp4_group), positions))
    kind = f"SubPlansSharedKVCache({len(plans)} stores, {storage}{', rotated' if spec.rotate else ''})"
    return gen.check_bytes(gen.GroupGeneration(name, decoder.tokens, cache_bytes(cache), positions, accounted, kind))


def generation_columns(row: dict | None) -> dict:
    """A row's generation columns from its :func:`~ced_csa2.eval.generation.generation_rows` entry (``None``: not
    decoded, every column ``None`` and the cache ``–``)."""
    if row is None:
        return {"gen_cache": "–", **{f"gen_{c}": None for c in ("agreement", "agreement_ci_low", "agreement_ci_high",
                                                                 "dnll", "dnll_ci_low", "dnll_ci_high")}}
    return {"gen_cache": row["cache"], "gen_agreement": row["agreement"],
            "gen_agreement_ci_low": row["agreement_ci95"][0], "gen_agreement_ci_high": row["agreement_ci95"][1],
            "gen_dnll": row["delta_nll"], "gen_dnll_ci_low": row["delta_nll_ci95"][0],
            "gen_dnll_ci_high": row["delta_nll_ci95"][1]}


def map_params(geo: Geometry, params: Params, group: str, plans: list[LayerPlan]) -> int:
    """Adapter parameters of every reader, plus one projector per Full layer for a CED group."""
    cfg = params.train_adapters
    readers = sum(len(p.targets) for p in plans)
    n = readers * adapter_params_per_target(geo.kv_dim, mlp_width(geo.kv_dim, cfg.width_mult), cfg.input)
    return n + (len(plans) * projector_params(geo.hidden_size, geo.kv_dim) if GROUPS[group].projected_source else 0)


def domain_columns(scores: dict[str, dict]) -> dict:
    """One row's other-domain columns from its :func:`~ced_csa2.eval.perplexity.groups_ppl` result per domain.

    ``<domain>_dppl_pct`` with ``_ci_low``/``_ci_high`` (0 for the baseline, as in domain), then
    ``worst_domain`` (``–`` for the baseline) and its ``worst_domain_dppl_pct`` with the interval.
    """
    row = {}
    for domain, s in scores.items():
        low, high = s.get("delta_pct_ci95", (0.0, 0.0))
        row |= {f"{domain}_dppl_pct": s.get("delta_pct", 0.0), f"{domain}_dppl_ci_low": low,
                f"{domain}_dppl_ci_high": high}
    worst = max(scores, key=lambda d: row[f"{d}_dppl_pct"]) if any("delta_pct" in s for s in scores.values()) \
        else None
    return row | {"worst_domain": worst or "–",
                  **{f"worst_domain_dppl_{c}": row[f"{worst}_dppl_{c}"] if worst else 0.0
                     for c in ("pct", "ci_low", "ci_high")}}


def budget_answer(rows: list[dict], basis: str) -> list[str]:
    """At which byte budgets on ``basis`` the best sharing row has a lower ΔPPL than the best FP4-alone row.

    At each budget (every row's bytes, fewest first) the best row of each family that fits it;
    consecutive budgets with the same winner are merged into one line.
    """
    key = f"bytes_{basis}"
    sharing = [r for r in rows if r["family"] == "sharing"]
    fp4 = [r for r in rows if r["family"] == "fp4_alone"]
    segments: list[tuple[float, str]] = []  # (the budget a verdict starts at, the verdict)
    for b in sorted({r[key] for r in rows}):
        best = {name: min((r for r in fam if r[key] <= b), key=lambda r: r["dppl_pct"], default=None)
                for name, fam in (("sharing", sharing), ("fp4", fp4))}
        s, f = best["sharing"], best["fp4"]
        if s is None:
            continue
        winner = "sharing" if f is None or s["dppl_pct"] < f["dppl_pct"] else "FP4 alone"
        what = (f"{winner}: best sharing {s['arm']} {s['dppl_pct']:+.2f}% [{s['dppl_ci_low']:+.2f}, "
                f"{s['dppl_ci_high']:+.2f}]" + ("; FP4 alone does not fit" if f is None else
                                                  f" vs {f['arm']} {f['dppl_pct']:+.2f}% [{f['dppl_ci_low']:+.2f}, "
                                                  f"{f['dppl_ci_high']:+.2f}]"))
        if not segments or segments[-1][1] != what:
            segments.append((b, what))
    ends = [f"{b:,.0f}" for b, _ in segments[1:]] + ["the baseline's bytes, and above"]
    return [f"- from {b:,.0f} B/token up to {end}: {what}" for (b, what), end in zip(segments, ends)]


def table(rows: list[dict], params: Params, study: Study, part: dict, seconds: float,
          train_seconds: dict[str, float]) -> str:
    """``sharing.md``: the protocol, one row per arm, the Pareto fronts and the byte-budget answer.

    ``part`` is the first part's record (:func:`run_part`: ``records``, ``tokens``, ``dtype``, ``domain_records``,
    ``prompts``; every part scores the same records), ``seconds`` the parts' wall times summed.
    """
    n, tokens, dtype, prompts = part["records"], part["tokens"], part["dtype"], part["prompts"]
    online, sgd = params.train.online, params.train_adapters
    how = {SEED_RECIPE: "the seed's K/V-MSE recipe, the pipeline's main branch (stage train_adapters' SGD on the "
                        f"dump's K/V pairs, {sgd.epochs} epochs, batch {sgd.batch_size}; stage train_projector's "
                        "AdamW) on the study's dump, each sub-plan as the pipeline trains its plan"}
    trained = "".join(
        f" `@{t.objective}` rows (k ∈ {{{', '.join(map(str, t.full_layers))}}}): the same maps trained by "
        + how.get(t.objective, f"the pipeline's `{t.objective}` objective (tune@{t.objective}'s phases of the groups "
                               f"the arms run; {online.records} train records of {online.seq_len} tokens, "
                               f"{online.epochs} epoch(s), batch {online.batch_size}, adapters lr "
                               f"{online.adapters_lr:g})")
        + f"; {train_seconds[t.objective] / 60:.1f} min." for t in study.trained)
    domains = ", ".join(f"{d} ({count} records)" for d, count in part["domain_records"].items())
    protocol = (
        f"Cross-layer sharing on {params.model.name} ({dtype}), cut after layer {params.plan.split}: k Full layers "
        "above the cut (evenly spaced from the first), every other attention layer above the cut a reader of the "
        "Full layer below it; ridge maps (the `ridge` objective, untrained) fitted on the study's own dump of "
        "prepare's training records (the pipeline's dump and ridge stages, run in a scratch folder)."
        f"{trained} "
        f"ΔPPL %, KL and top-1 against the baseline with paired bootstrap 95% intervals over {n} held-out "
        f"{params.data.name} records ({tokens:,} scored tokens, teacher-forced, eval_ppl.records), in domain; "
        f"worst other domain: the largest ΔPPL % of the same scoring on each other domain (data.domains, "
        f"eval_ppl.domain_records: {domains or 'none'}), its interval over that domain's records. "
        f"Bytes per token counted in {BYTES} (FP4: {params.kv_format}), on the whole cache (all attention layers) "
        "and the decoder basis (attention layers above the cut); compression against the baseline's. Map "
        "parameters are weights, not per-token bytes. `pipeline:` rows are the pipeline's own groups (plan "
        f"source {params.plan.source}, readers {list(params.plan.targets)}; `@ridge`: the ridge stage's maps; "
        "`xkv`: the fit_xkv stage's bases), "
        f"scored in the same run as the k = {part['k']} arms. Each k is its own run (`sharing_part@<k>` of "
        "studies/dvc.yaml: its own dump, maps and baseline, the same records), paired with its own baseline. "
        f"Generation: {prompts} held-out prompts of {params.eval_generation.prompt_tokens} tokens (eval_generation's), "
        f"{params.eval_generation.new_tokens} greedy tokens through the cache that holds the row's bytes (an arm's: one "
        "store per Full layer, the readers nothing; used bytes checked against the accounting), against the "
        "baseline's continuation: agreement (the fraction of positions with the baseline's token) and gen ΔNLL (the "
        "plain model's NLL per token of the continuation minus the baseline's, nats), bootstrap 95% intervals over "
        "prompts, paired; `–` where no cache composes the arm (an every-layer FP4 group around sub-plans). "
        "Embedded default, not a Qwen3.5-4B result. "
        f"Study wall time {seconds / 60:.1f} min (the parts' summed).")
    lines = [protocol, "",
             "| arm | Full layers | readers | B/token whole | × whole | B/token decoder | × decoder | "
             "ΔPPL % [95% CI] | ΔPPL % worst other domain [95% CI] | KL | top-1 % | agreement [95% CI] | "
             "gen ΔNLL [95% CI] | readers' ridge R² | map params | front whole / decoder |",
             "|---|---|---:|---:|---:|---:|---:|---|---|---:|---:|---|---|---:|---:|:---:|"]
    for r in rows:
        d, worst = ("–", "–") if r["arm"] == "pipeline:baseline" else \
            (f"{r['dppl_pct']:+.2f} [{r['dppl_ci_low']:+.2f}, {r['dppl_ci_high']:+.2f}]",
             f"{r['worst_domain_dppl_pct']:+.2f} [{r['worst_domain_dppl_ci_low']:+.2f}, "
             f"{r['worst_domain_dppl_ci_high']:+.2f}] ({r['worst_domain']})")
        r2 = f"{r['ridge_r2']:.3f}" if r["ridge_r2"] is not None else "–"
        agree, dnll = ("–", "–") if r["gen_agreement"] is None or r["arm"] == "pipeline:baseline" else (
            f"{r['gen_agreement']:.3f} [{r['gen_agreement_ci_low']:.3f}, {r['gen_agreement_ci_high']:.3f}]",
            f"{r['gen_dnll']:+.3f} [{r['gen_dnll_ci_low']:+.3f}, {r['gen_dnll_ci_high']:+.3f}]")
        front = f"{'✓' if r['front_all_attention'] else '·'} / {'✓' if r['front_decoder_attention'] else '·'}"
        lines.append(f"| {r['arm']} | {r['full_layers']} | {r['readers']} | {r['bytes_all_attention']:,.0f} | "
                     f"{r['x_all_attention']:.2f} | {r['bytes_decoder_attention']:,.0f} | "
                     f"{r['x_decoder_attention']:.2f} | {d} | {worst} | {r['kl']:.4f} | {r['top1_pct']:.1f} | {agree} | "
                     f"{dnll} | {r2} | "
                     f"{r['map_params']:,} | {front} |")
    for basis in ("all_attention", "decoder_attention"):
        lines += ["", f"Where sharing (alone or with FP4) beats FP4 alone ({', '.join(FP4_ALONE)}), by budget on the "
                      f"{basis} basis (the best row of each family within the budget, point estimates; "
                      "intervals against the baseline):", "", *budget_answer(rows, basis)]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, model: str) -> None:
    """Whole-cache bytes vs ΔPPL (log), every row numbered, the Pareto front joined."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    pts = [r for r in rows if r["arm"] != "pipeline:baseline"]
    floor = 0.1
    for i, r in enumerate(pts, 1):
        y = max(r["dppl_pct"], floor)
        err = [[y - max(min(r["dppl_ci_low"], y), floor)], [max(r["dppl_ci_high"], y) - y]]
        ax.errorbar(r["bytes_all_attention"], y, yerr=err, marker="o", capsize=2, linewidth=0.8,
                    color="#dd8452" if r["front_all_attention"] else ("#55a868" if r["family"] == "fp4_alone"
                                                                     else "#4c72b0"))
        ax.annotate(str(i), (r["bytes_all_attention"], y), textcoords="offset points", xytext=(4, 2), fontsize=7)
    front = sorted((r for r in rows if r["front_all_attention"]), key=lambda r: r["bytes_all_attention"])
    ax.plot([r["bytes_all_attention"] for r in front], [max(r["dppl_pct"], floor) for r in front],
            drawstyle="steps-post", color="#dd8452", linewidth=1, label="Pareto front (orange points)")
    ax.set_yscale("log")
    ax.set_xlabel(f"stored KV bytes/token ({BYTES}, whole cache: all attention layers)")
    ax.set_ylabel("ΔPPL % vs baseline (log; bars: paired 95% CI)")
    ax.set_title(f"Cross-layer sharing vs FP4 ({model}; green: FP4 alone)", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    key = "\n".join(f"{i} {r['arm']}" + (" *" if r["front_all_attention"] else "") for i, r in enumerate(pts, 1))
    ax.text(1.02, 1.0, key + "\n(* on the front)", transform=ax.transAxes, va="top", fontsize=6.5, family="monospace")
    write_png(fig, path)


PART_PROVENANCE = ("seed", "model", "plan", "dump", "split", "ridge", "xkv", "kv_format", "train_adapters",
                   "train_projector", "train.ced_csa2_start", "train.online", "data.name", "data.max_tokens",
                   "data.domains", "eval_ppl", "eval_generation.prompts", "eval_generation.prompt_tokens", "eval_generation.new_tokens",
                   "eval_generation.batch_size")  # the root params of studies/dvc.yaml's sharing_part and sharing


PART_KEYS = {"k", "study", "provenance", "records", "tokens", "dtype", "domain_records", "prompts", "train_seconds",
             "seconds", "columns", "rows"}  # what run_part writes


def part_path(k: int) -> Path:
    """Where the part of ``k`` Full layers writes its rows: ``studies/sharing/parts/k<k>/part.json``."""
    return OUT / "parts" / f"k{k}" / "part.json"


def study_key(study: Study) -> dict:
    """What a part was made for besides its ``k``: the study's params but ``full_layers`` (the parts' list)."""
    return {key: value for key, value in to_dict(study).items() if key != "full_layers"}


def run_part(k: int) -> None:
    """The arm family of ``k`` Full layers: its maps fitted (and trained) on the study's own dump, every arm of ``k``
    and the pipeline's groups scored in domain and on every other domain, decoded through their caches.

    Writes :func:`part_path` (``{"k", "study", "provenance", "records", "tokens", "dtype", "domain_records",
    "prompts", "train_seconds", "seconds", "columns", "rows"}``; the rows without the columns only every part
    together gives: compression against the baseline and the Pareto fronts) and ``timings/study_sharing_k<k>.json``.
    """
    t0 = time.perf_counter()
    params = load_params(Path("params.yaml"))
    # before anything else is read, as every study: a corpus made for other params
    check_prepared(params, Path("."), EVAL_JSONL, TRAIN_JSONL)
    study = load_study()
    if k not in study.full_layers:
        raise ValueError(f"{STUDY_PARAMS}: full_layers {study.full_layers} has no k = {k}: run the part of one of them")
    check_prepared(params, Path("."), *(domain_jsonl(d.name) for d in params.data.domains))
    plan, geo = load_plan(params.plan, params.model)
    plans = study_plans(geo, plan.split, study)[k]  # refuses a k that leaves a Full layer without readers
    if any(GROUPS[a[-1]].projected_source for a in study.arms) and params.train.ced_csa2_start != "csa2":
        raise ValueError(f"{STUDY_PARAMS}: a ced_csa2 arm reads csa2's ridge adapters (train.ced_csa2_start: csa2); "
                         f"params.yaml has train.ced_csa2_start: {params.train.ced_csa2_start}")
    fp4_group = FP4_FORMATS[params.kv_format]().group
    trains = [t.objective for t in study.trained if k in t.full_layers]
    maps_of, train_seconds = {}, {}
    # The maps first, on the study's own dump (the pipeline's stages in a scratch folder), then the model.
    with tempfile.TemporaryDirectory(prefix="sharing_") as scratch:
        workdir = Path(scratch)
        copy_prepared(workdir, TRAIN_JSONL)
        dump.run(params, workdir)
        ridge.run(params, workdir)
        pipeline_parts = ridge_served(params, plan, geo, workdir)  # the pipeline's ridge objective on this dump
        if any(GROUPS[g].low_rank for g in study.pipeline_groups):  # xkv: the fit_xkv stage's bases, as eval_ppl's
            fit_xkv.run(params, workdir)
            xkv = load_xkv(workdir / XKV_PATH, role=MAIN, expect=expected_meta(params, plan, geo)["xkv"])
            check_meta_provenance(workdir / XKV_PATH, xkv.meta, params, MAIN)
            pipeline_parts |= {g: CEDParts(xkv=xkv) for g in study.pipeline_groups if GROUPS[g].low_rank}
        maps_of["ridge"], r2 = fit_sub_plans(params, plans, geo, workdir, workdir / "sub_plans")
        if SEED_RECIPE in trains:  # the dump's K/V pairs, before the scratch folder goes
            t_train = time.perf_counter()
            maps_of[SEED_RECIPE] = train_seed_recipe(params, plans, geo, workdir, workdir / "sub_plans")
            train_seconds[SEED_RECIPE] = round(time.perf_counter() - t_train, 1)
    model, tok = load_model_and_tokenizer(params.model, device=resolve_device(params.eval_ppl.device))
    model.requires_grad_(False)
    # Every domain's records before any training or scoring: a missing or short domain file fails in seconds.
    ids = eval_ids(params, tok, Path("."))
    domain_ids = {d.name: eval_ids(params, tok, Path("."), d.name) for d in params.data.domains}
    cfg = params.eval_generation
    gen.check_window(model.config, cfg.prompt_tokens, cfg.new_tokens)
    prompts = gen.prompt_ids(read_records(EVAL_JSONL), EVAL_JSONL, tok, cfg.prompts, cfg.prompt_tokens, params.seed,
                             EVAL_SAMPLE_STREAM).to(next(model.parameters()).device)
    for objective in trains:
        if objective != SEED_RECIPE:
            t_train = time.perf_counter()
            maps_of[objective] = train_sub_plans(objective, params, plans, maps_of["ridge"],
                                                 {a[-1] for a in study.arms}, model, tok, Path("."))
            train_seconds[objective] = round(time.perf_counter() - t_train, 1)
    families = [(arm, o) for arm in study.arms for o in study.objectives if study.trains(o, k)]  # ridge row first
    runtimes = {arm_name(k, arm, o): arm_runtime(model, arm, plans, maps_of[o], params.kv_format)
                for arm, o in families}
    log.info("k = %d: scoring %d arms and %d pipeline groups on %d records", k, len(runtimes),
             len(study.pipeline_groups), len(ids))
    scores = groups_ppl(model, plan, study.pipeline_groups, pipeline_parts, ids, params, tok.pad_token_id,
                        extra=runtimes)
    domain_scores = {}
    for domain, d_ids in domain_ids.items():
        log.info("scoring every arm on the other domain %s: %d records", domain, len(d_ids))
        domain_scores[domain] = groups_ppl(model, plan, study.pipeline_groups, pipeline_parts, d_ids, params,
                                           tok.pad_token_id, extra=runtimes)
    arms = {pipeline_name(g): (0, [g], [plan], "ridge") for g in study.pipeline_groups}
    arms |= {arm_name(k, arm, o): (k, arm, plans, o) for arm, o in families}
    # Generation through the real caches: the pipeline's groups (the baseline, the reference, among them), each arm
    t_gen = time.perf_counter()
    decodable = [g for g in study.pipeline_groups if gen.cache_refusal(g) is None]
    runs = gen.run_groups(model, plan, decodable, pipeline_parts, prompts, cfg.new_tokens, params.kv_format).runs
    for arm, o in Progress(families, desc="generation", unit="arm"):
        name = arm_name(k, arm, o)
        run = arm_generation(model, geo, name, arm, plans, maps_of[o], prompts, cfg.new_tokens, params.kv_format,
                             fp4_group)
        if run is not None:
            runs[name] = run
    generated = gen.generation_rows(model, prompts, runs, seed=params.seed, batch_size=cfg.batch_size)
    log.info("%d rows decoded through their caches (%d prompts x %d tokens) in %.1f s", len(runs), len(prompts),
             cfg.new_tokens, time.perf_counter() - t_gen)
    rows, scored_as = [], {name: arm[0] if k_ == 0 else name for name, (k_, arm, _, _) in arms.items()}
    for name, (k_, arm, ps, objective) in arms.items():
        s = scores[scored_as[name]]
        shares = GROUPS[arm[-1]].shares_source_kv
        row = {"arm": name, "k": k_, "objective": objective if GROUPS[arm[-1]].uses_maps else "–",
               "full_layers": " ".join(str(p.source) for p in ps) if shares else "–",
               "readers": sum(len(p.targets) for p in ps) if shares else 0,
               "family": "fp4_alone" if k_ == 0 and arm[0] in FP4_ALONE else
               ("sharing" if shares else "low_rank" if GROUPS[arm[0]].low_rank else "baseline")}
        for basis in BASES:
            row[f"bytes_{basis}"] = arm_bytes(geo, arm, ps, basis, fp4_group)
        row |= {"dppl_pct": s.get("delta_pct", 0.0), "dppl_ci_low": s.get("delta_pct_ci95", (0.0, 0.0))[0],
                "dppl_ci_high": s.get("delta_pct_ci95", (0.0, 0.0))[1], "kl": s.get("kl", 0.0),
                "top1_pct": s.get("top1_pct", 100.0), "ppl": s["ppl"],
                "ridge_r2": round(sum(r2[p] for p in ps) / len(ps), 4) if k_ else None,
                "map_params": map_params(geo, params, arm[-1], ps) if GROUPS[arm[-1]].uses_maps else 0,
                "records": len(ids), "tokens": s["tokens"], "dtype": str(model.dtype).removeprefix("torch."),
                "kv_format": params.kv_format}
        row |= domain_columns({d: ds[scored_as[name]] for d, ds in domain_scores.items()})
        row |= generation_columns(generated.get(scored_as[name]))
        rows.append(row)
    seconds = round(time.perf_counter() - t0, 1)
    part = {"k": k, "study": study_key(study), "provenance": provenance(params, *PART_PROVENANCE),
            "records": len(ids), "tokens": rows[0]["tokens"], "dtype": rows[0]["dtype"],
            "domain_records": {d: len(d_ids) for d, d_ids in domain_ids.items()}, "prompts": len(prompts),
            "train_seconds": train_seconds, "seconds": seconds, "columns": list(rows[0]),
            "rows": [[r[c] for c in rows[0]] for r in rows]}
    assert set(part) == PART_KEYS  # what load_part checks a file for
    write_json(part_path(k), part)
    write_json(TIMINGS / f"study_sharing_k{k}.json", {"seconds": seconds, "train_seconds": train_seconds,
                                                      "threads": torch.get_num_threads()})


def load_part(k: int, study: Study, params: Params) -> dict:
    """The part of ``k`` (:func:`run_part`), refused in one line naming its file when missing or made for other
    params; its ``rows`` as dicts."""
    path = part_path(k)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing: run `dvc repro studies/dvc.yaml:sharing_part@{k}` (or `python "
                                f"studies/sharing.py --k {k}`) before combining the parts")
    again = f"run `python studies/sharing.py --k {k}` again"
    try:
        part = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc}): {again}") from None
    missing = PART_KEYS - set(part) if isinstance(part, dict) else PART_KEYS
    if missing:
        raise ValueError(f"{path}: not a part of this study (no {', '.join(sorted(missing))}): {again}")
    if part["k"] != k or part["study"] != study_key(study):
        raise ValueError(f"{path}: was made for k = {part['k']} and study params {part['study']}, "
                         f"{STUDY_PARAMS} asks for k = {k} with {study_key(study)}: run that part again")
    check_provenance(path, part["provenance"], params)
    return part | {"rows": [dict(zip(part["columns"], values)) for values in part["rows"]]}


def combine() -> None:
    """Every part of ``full_layers`` in one table: the pipeline's rows (the first part's), then each ``k``'s arms;
    compression against the baseline and the Pareto fronts over them all; ``sharing.tsv``, ``sharing.md`` and
    ``frontier.png``."""
    params = load_params(Path("params.yaml"))
    study = load_study()
    parts = [load_part(k, study, params) for k in study.full_layers]  # every part checked before anything is written
    rows = [r for r in parts[0]["rows"] if r["k"] == 0] + [r for p in parts for r in p["rows"] if r["k"] != 0]
    base = {basis: next(r for r in rows if r["arm"] == "pipeline:baseline")[f"bytes_{basis}"] for basis in BASES}
    fronts = {}
    for basis in BASES:
        points = frontier({r["arm"]: {"kv_bytes": r[f"bytes_{basis}"], "kv_compression": 1.0,
                                      "dppl_pct": r["dppl_pct"]} for r in rows})
        fronts[basis] = {p["name"] for p in points if p["front"]}
    columns = list(rows[0])
    at = columns.index("kv_format") + 1  # after the in-domain columns, which keep their places
    rows = [{**{c: r[c] for c in columns[:at]},
             **{f"x_{basis}": base[basis] / r[f"bytes_{basis}"] for basis in BASES},
             **{f"front_{basis}": r["arm"] in fronts[basis] for basis in BASES},
             **{c: r[c] for c in columns[at:]}} for r in rows]
    train_seconds = {t.objective: sum(p["train_seconds"].get(t.objective, 0.0) for p in parts) for t in study.trained}
    first = parts[0]
    write_tsv(OUT / "sharing.tsv", rows)
    atomic_write_text(OUT / "sharing.md", table(rows, params, study, first, sum(p["seconds"] for p in parts),
                                                train_seconds))
    plot(rows, OUT / "frontier.png", params.model.name)


def arguments() -> ArgumentParser:
    ap = ArgumentParser(prog="python studies/sharing.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=None,
                    help="run the part of k Full layers (one of full_layers in studies/sharing.yaml) into "
                         "studies/sharing/parts/k<k>/; without it, combine every part into the tables and the plot")
    return ap


def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.k is None:
        combine()
    else:
        run_part(args.k)


if __name__ == "__main__":
    run_study(main, arguments())
