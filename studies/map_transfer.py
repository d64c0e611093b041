"""Is the off-domain cost the maps' or the domain's: each map's K/V error and each group's ΔPPL, domain by domain.

    dvc repro studies/dvc.yaml:map_transfer       # runs: python studies/map_transfer.py

Issue 61 bounds a group's worst other domain at 1.3× its in-domain ΔPPL, and the maps fitted on Wikipedia
cost 1.3-4× more on other text.  Two things multiply there: how much worse the *maps* predict K/V on text
they were not fitted on (transfer proper), and how much more the *model* loses on that text for the same
K/V error (the domain's sensitivity: on math and code a token rests on fewer, sharper attention reads).
This study separates them on the same held-out records ``eval_ppl`` scores:

* **the maps' error**: the ridge objective's maps (the pipeline's ``dump`` stage on ``prepare``'s training
  records, in a scratch folder so that the study reads nothing made on another CPU, then its ``ridge``
  stage) predict each domain's true K/V, captured as ``dump`` captures them (pre-norm, pre-RoPE, every
  real token): the projector (``ced``: the source's K and V from ``H_split``; also past its first
  ``sink`` positions, the entries ``ced_sink`` projects), ``csa2``'s adapters (the targets' K/V from the
  true source's) and ``ced_csa2``'s (from the projected source).  Relative error
  ``Σ(ŷ - y)² / Σ y²`` per domain, and its ratio to the in-domain one with a 95% interval (records of
  each domain resampled apart, ``n_boot`` times, seed ``seed``): 1.0 is a map that transfers perfectly.
* **the cost**: ΔPPL of the mapped groups and of ``controls`` -- groups that fit nothing (FP4 and
  FP6/FP4 storage of every layer) -- per domain (paired 95% intervals), as ``eval_ppl`` scores them, and
  each group's worst other domain over its in-domain ΔPPL: a control's ratio is the domain's sensitivity
  alone, as no map of it was fitted anywhere.

Writes ``studies/map_transfer/transfer.tsv`` (one row per group or map and domain), ``transfer.md`` and
the wall time to ``timings/study_map_transfer.json``.  Params: ``studies/map_transfer.yaml`` and the
root ``params.yaml`` (model, plan, dump, split, ridge, eval records, domains, kv_format, seed).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from ced_csa2.config import Params, from_dict, load_params
from ced_csa2.data.dumping import forward_batch
from ced_csa2.data.records import check_prepared, pad_batch
from ced_csa2.eval.perplexity import eval_ids, groups_ppl
from ced_csa2.groups import GROUPS, MAP_GROUPS
from ced_csa2.model_utils import load_model_and_tokenizer, resolve_device
from ced_csa2.pipeline.atomic_files import atomic_write_text, write_json, write_tsv
from ced_csa2.pipeline.paths import EVAL_JSONL, TIMINGS, TRAIN_JSONL, domain_jsonl, provenance_path
from ced_csa2.pipeline.progress import Progress
from ced_csa2.pipeline.study_runner import run_study
from ced_csa2.plan import LayerPlan, load_plan
from ced_csa2.stages import dump, ridge
from ced_csa2.train.tuning import ridge_served

STUDY_PARAMS = Path("studies/map_transfer.yaml")
OUT = Path("studies/map_transfer")
TRANSFER_BOUND = 1.3  # issue 61: worst other domain's ΔPPL at most 1.3x the in-domain one
log = logging.getLogger("map_transfer")


@dataclass(frozen=True)
class Study:
    groups: list[str]  # groups scored with the ridge objective's maps
    controls: list[str]  # groups that fit no map: the domains' sensitivity alone
    n_boot: int  # resamples of the error ratios' intervals


def load_study(path: Path = STUDY_PARAMS) -> Study:
    """The study's params, typed and checked, each failure one line naming the file and key."""
    try:
        study = from_dict(Study, yaml.safe_load(path.read_text()))
    except ValueError as err:  # an unknown key, a wrong type, an entry twice: the file named first
        raise ValueError(f"{path}: {err}") from None
    if not study.groups or any(g not in MAP_GROUPS or GROUPS[g].low_rank for g in study.groups):
        raise ValueError(f"{path}: groups must list groups that run the projector or adapters "
                         f"({', '.join(g for g in MAP_GROUPS if not GROUPS[g].low_rank)}), got {study.groups}")
    if any(g not in GROUPS or g in MAP_GROUPS or g == "baseline" for g in study.controls):
        raise ValueError(f"{path}: controls must list groups other than baseline that fit no map "
                         f"({', '.join(g for g in GROUPS if g not in MAP_GROUPS and g != 'baseline')}), "
                         f"got {study.controls}")
    if study.n_boot < 100:
        raise ValueError(f"{path}: n_boot must be at least 100 for a 95% interval, got {study.n_boot}")
    return study


def map_pair(group: str) -> str:
    """The maps a group runs: ``ced_csa2``'s pair where it projects its source and adapts it, else ``csa2``'s."""
    g = GROUPS[group]
    return "ced_csa2" if g.projected_source and g.adapters else "csa2"


@torch.inference_mode()
def map_errors(model, plan: LayerPlan, served: dict, ids: list[list[int]], batch_size: int, pad_id: int,
               sink: int) -> dict[str, np.ndarray]:
    """Per record, each map's summed squared error and the truth's summed squares, K and V apart.

    Returns
    -------
    dict
        ``{"<map>/<k|v>": (R, 2) float64}``, column 0 ``Σ(ŷ - y)²``, column 1 ``Σ y²`` over the record's
        tokens (and, for the targets, over every target layer); maps ``projector``, ``projector@sink``
        (positions from ``sink`` on), ``csa2_adapters``, ``ced_csa2_adapters``.
    """
    s = plan.source
    out: dict[str, list] = {}

    def add(name: str, pred: torch.Tensor, true: torch.Tensor, record: int) -> None:
        rows = out.setdefault(name, [])
        if len(rows) == record:
            rows.append([0.0, 0.0])
        rows[record][0] += float(((pred.double() - true.double()) ** 2).sum())
        rows[record][1] += float((true.double() ** 2).sum())

    record = 0
    for start in Progress(range(0, len(ids), batch_size), desc="map errors", unit="batch"):
        rows = ids[start:start + batch_size]
        x, mask = pad_batch(rows, pad_id)
        arrays = {name: torch.from_numpy(a) for name, a in forward_batch(model, plan, x, mask, "float32").items()}
        at = 0
        for n in (len(r) for r in rows):
            cut = {name: a[at:at + n] for name, a in arrays.items()}
            at += n
            k_hat, v_hat = served["csa2"].project(s, plan, cut["h_split"])
            k_ced, v_ced = served["ced_csa2"].project(s, plan, cut["h_split"])
            for name, kept in (("projector", slice(None)), ("projector@sink", slice(sink, None))):
                for kind, pred in (("k", k_hat), ("v", v_hat)):
                    add(f"{name}/{kind}", pred[kept], cut[f"{kind}_{s}"][kept], record)
            for t in plan.targets:
                for name, (k_in, v_in) in (("csa2_adapters", (cut[f"k_{s}"], cut[f"v_{s}"])),
                                           ("ced_csa2_adapters", (k_ced, v_ced))):
                    pair = "csa2" if name == "csa2_adapters" else "ced_csa2"
                    k_t, v_t = served[pair].adapters(t, k_in, v_in)
                    add(f"{name}/k", k_t, cut[f"k_{t}"], record)
                    add(f"{name}/v", v_t, cut[f"v_{t}"], record)
            record += 1
    return {name: np.asarray(rows, dtype=np.float64) for name, rows in out.items()}


def error_ratio(home: np.ndarray, away: np.ndarray, n_boot: int, seed: int) -> dict:
    """Relative error ``Σ SSE / Σ y²`` away over at home, and its 95% percentile interval.

    ``home``, ``away``: ``(R, 2)`` per-record ``(SSE, Σ y²)`` of two different record sets, so each is
    resampled on its own (the same generator, ``seed``, for every map and domain)."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, len(home), (n_boot, len(home)))
    b = rng.integers(0, len(away), (n_boot, len(away)))
    rel = lambda x, idx: x[idx, 0].sum(-1) / x[idx, 1].sum(-1)  # noqa: E731
    ratios = rel(away, b) / rel(home, a)
    value = (away[:, 0].sum() / away[:, 1].sum()) / (home[:, 0].sum() / home[:, 1].sum())
    return {"value": float(value), "ci95": [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]}


def table(rows: list[dict], params: Params, corpus: str, study: Study, sink: int, seconds: float) -> str:
    """``transfer.md``: the maps' relative K/V error per domain and its ratio to in domain; the groups' ΔPPL."""
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    n = {d: next(r["records"] for r in rows if r["domain"] == d) for d in domains}
    first = rows[0]
    lines = [f"Map transfer on {params.model.name} ({first['dtype']}): the ridge objective's maps (the pipeline's dump "
             f"of prepare's {corpus} training records, ridge λ {params.ridge.lam:g}) and the groups on each domain's "
             "held-out records (n: " + ", ".join(f"{d} {n[d]}" for d in domains) + "), teacher-forced. Embedded "
             f"default, not a Qwen3.5-4B result. Study wall time {seconds / 60:.1f} min.", "",
             "The maps' relative K/V error Σ(ŷ−y)²/Σy² (every real token; `projector@sink` from position "
             f"{sink} on, what `ced_sink` projects), and × its {corpus} value [95% CI, records resampled per domain]:",
             "", "| map | " + " | ".join(domains) + " |", "|---|" + "---|" * len(domains)]
    errors = [r for r in rows if r["kind"] == "map"]
    for name in dict.fromkeys(r["name"] for r in errors):
        cells = []
        for d in domains:
            r = next(r for r in errors if (r["name"], r["domain"]) == (name, d))
            cells.append(f"{r['rel_error']:.3f}" if d == corpus else
                         f"{r['rel_error']:.3f} (×{r['ratio']:.2f} [{r['ratio_ci_low']:.2f}, {r['ratio_ci_high']:.2f}])")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"ΔPPL % [paired 95% CI] per domain; × the worst other domain over {corpus} (issue 61's bound: ≤ "
                  f"{TRANSFER_BOUND}×). Controls fit no map: their × is the domain's sensitivity alone.", "",
              "| group | " + " | ".join(domains) + " | worst × |", "|---|" + "---|" * len(domains) + "---:|"]
    costs = [r for r in rows if r["kind"] != "map"]
    for g in [*study.groups, *study.controls]:
        mine = {r["domain"]: r for r in costs if r["name"] == g}
        worst = max((d for d in domains if d != corpus), key=lambda d: mine[d]["dppl_pct"], default=None)
        ratio = (f"{mine[worst]['dppl_pct'] / mine[corpus]['dppl_pct']:.2f} ({worst})"
                 if worst and mine[corpus]["dppl_pct"] > 0 else "–")
        label = g + (" (control)" if g in study.controls else "")
        lines.append(f"| {label} | " + " | ".join(
            f"{mine[d]['dppl_pct']:+.2f} [{mine[d]['dppl_ci_low']:+.2f}, {mine[d]['dppl_ci_high']:+.2f}]"
            for d in domains) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    t0 = time.perf_counter()
    params = load_params(Path("params.yaml"))
    check_prepared(params, Path("."), TRAIN_JSONL, EVAL_JSONL, *(domain_jsonl(d.name) for d in params.data.domains))
    study = load_study()
    corpus = params.data.name
    sink = GROUPS["ced_sink"].sink
    plan, geo = load_plan(params.plan, params.model)
    model, tok = load_model_and_tokenizer(params.model, device=resolve_device(params.eval_ppl.device))
    model.requires_grad_(False)
    ids = {corpus: eval_ids(params, tok, Path("."))} | {d.name: eval_ids(params, tok, Path("."), d.name)
                                                       for d in params.data.domains}
    with tempfile.TemporaryDirectory(prefix="map_transfer_") as scratch:
        workdir = Path(scratch)
        for file in (TRAIN_JSONL, provenance_path(TRAIN_JSONL)):  # prepare's records and what vouches for them
            (workdir / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, workdir / file)
        dump.run(params, workdir)
        ridge.run(params, workdir)
        served = ridge_served(params, plan, geo, workdir)
    dtype = str(model.dtype).removeprefix("torch.")
    errors, rows = {}, []
    for domain, domain_ids in ids.items():
        log.info("%s: the maps' K/V error and %d groups' ΔPPL on %d records", domain,
                 len(study.groups) + len(study.controls), len(domain_ids))
        errors[domain] = map_errors(model, plan, served, domain_ids, params.eval_ppl.batch_size, tok.pad_token_id, sink)
        scores = groups_ppl(model, plan, ["baseline", *study.controls, *study.groups],
                            {g: served[map_pair(g)] for g in study.groups}, domain_ids, params, tok.pad_token_id)
        for g in [*study.groups, *study.controls]:
            s = scores[g]
            rows.append({"kind": "control" if g in study.controls else "group", "name": g, "domain": domain,
                         "dppl_pct": s["delta_pct"], "dppl_ci_low": s["delta_pct_ci95"][0],
                         "dppl_ci_high": s["delta_pct_ci95"][1], "rel_error": None, "ratio": None,
                         "ratio_ci_low": None, "ratio_ci_high": None,
                         "records": len(domain_ids), "tokens": s["tokens"], "dtype": dtype})
    for domain, per_map in errors.items():
        for name, values in per_map.items():
            home = errors[corpus][name]
            r = error_ratio(home, values, study.n_boot, params.seed)
            rows.append({"kind": "map", "name": name, "domain": domain, "dppl_pct": None,
                         "dppl_ci_low": None, "dppl_ci_high": None, "ratio_ci_low": r["ci95"][0], "ratio_ci_high": r["ci95"][1],
                         "rel_error": float(values[:, 0].sum() / values[:, 1].sum()), "ratio": r["value"],
                         "records": len(values), "tokens": None, "dtype": dtype})
    seconds = time.perf_counter() - t0
    write_tsv(OUT / "transfer.tsv", rows)
    atomic_write_text(OUT / "transfer.md", table(rows, params, corpus, study, sink, seconds))
    write_json(TIMINGS / "study_map_transfer.json", {"seconds": round(seconds, 1), "threads": torch.get_num_threads()})


if __name__ == "__main__":
    run_study(main)
