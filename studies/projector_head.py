"""CED projectors beyond a linear map: the ridge map plus a residual MLP, widths swept.

    dvc repro studies/dvc.yaml       # runs: python studies/projector_head.py

Every linear ``H_split -> KV_source`` lands on the ridge optimum (the main branch's ``ced`` is
the ridge map itself).  Here the source layer's projector gets the CSA2 adapters' form
(:class:`ced_csa2.maps.residual_projector.ResidualProjector`): the ridge map, frozen, plus a
zero-initialised ``Linear -> GELU -> Linear`` whose output is added, trained by K/V MSE on the
dump (the projector's rows and split) and kept at its best held-out epoch.  Per width:

* held-out K and V R² against the ridge map's on the same rows, the parameters and the MLP's
  extra multiply-adds per prefill token (nothing more is stored per token);
* ΔPPL % (paired bootstrap 95% CI over records), KL(baseline ‖ group) and top-1 agreement of
  ``ced`` (the projector alone) and of ``ced_csa2`` (with the main branch's adapters, as the
  pipeline's ``ced_csa2``) on the pipeline's eval records, next to the ridge map's rows.

Writes ``studies/projector_head/metrics.json`` and ``heads.md``.  Params:
``studies/projector_head.yaml`` and the root ``params.yaml``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from ced_csa2.ced_runtime import CEDModeBRuntime, load_parts
from ced_csa2.config import Params, from_dict, load_params
from ced_csa2.data.records import check_prepared
from ced_csa2.eval.perplexity import agreement, eval_ids
from ced_csa2.eval.scoring import multi_group_nll
from ced_csa2.eval.stats import paired_deltas
from ced_csa2.train.residual_projector_training import HeadConfig, train_residual_projector
from ced_csa2.model_utils import load_model_and_tokenizer, resolve_device
from ced_csa2.pipeline.atomic_files import atomic_write_text, write_json
from ced_csa2.pipeline.map_roles import MAIN
from ced_csa2.pipeline.paths import DUMP_PATH, EVAL_JSONL, MODELS, RIDGE_PATH
from ced_csa2.pipeline.study_runner import run_study
from ced_csa2.plan import load_plan
from ced_csa2.train.projector_training import ridge_fitted
from ced_csa2.train.training import split_masks

STUDY_PARAMS = Path("studies/projector_head.yaml")
OUT = Path("studies/projector_head")
GROUPS = ("ced", "ced_csa2")
log = logging.getLogger("projector_head")


@dataclass(frozen=True)
class Study:
    widths: list[int]
    train: HeadConfig


def load_study(path: Path = STUDY_PARAMS) -> Study:
    """The study's params, typed and checked (unknown or mistyped keys refused, naming them)."""
    study = from_dict(Study, yaml.safe_load(path.read_text()))
    if not study.widths or min(study.widths) < 1:
        raise ValueError(f"{path}: widths must be positive and at least one, got {study.widths}")
    return study


def _fit(m: dict) -> dict:
    return {"r2_k": m["k"]["r2"], "r2_v": m["v"]["r2"], "val_loss": m["val_loss"]}


def run(params: Params, study: Study, workdir: Path = Path("."), *, model_and_tok=None) -> dict:
    plan, geo = load_plan(params.plan, params.model)
    t0 = time.perf_counter()
    dump, ridge = workdir / DUMP_PATH, workdir / RIDGE_PATH
    train_mask, val_mask = split_masks(dump, params, plan, geo, [plan.source], tokens_per_record=0)
    main = load_parts(workdir / MODELS, params, plan, geo, role=MAIN, extra_sources=False)  # the main branch's adapters
    reference = ridge_fitted(params, dump, ridge, [plan.source], geo, val_mask, 4096)
    heads = {"ridge": (reference.projectors[plan.source], {**_fit(reference.layers[plan.source]), "width": 0,
                                                           "parameters": 2 * geo.kv_dim * (geo.hidden_size + 1),
                                                           "extra_macs_per_token": 0, "kept_epoch": 0, "train_s": 0.0})}
    for width in study.widths:
        t = time.perf_counter()
        head, fit = train_residual_projector(params, dump, ridge, plan.source, geo, width, study.train,
                                             train_mask, val_mask)
        heads[f"mlp{width}"] = (head, {**_fit(fit), "width": width, "parameters": head.parameter_count(),
                                       "extra_macs_per_token": width * (geo.hidden_size + 2 * geo.kv_dim),
                                       "kept_epoch": fit["kept_epoch"], "steps": fit["steps"],
                                       "train_rows": fit["train_rows"], "val_rows": fit["val_rows"],
                                       "train_s": round(time.perf_counter() - t, 1)})
        log.info("width %d: held-out R² K %.4f V %.4f (ridge %.4f / %.4f), kept epoch %d", width, fit["k"]["r2"],
                 fit["v"]["r2"], heads["ridge"][1]["r2_k"], heads["ridge"][1]["r2_v"], fit["kept_epoch"])
    model, tok = model_and_tok or load_model_and_tokenizer(params.model, device=resolve_device(params.eval_ppl.device))
    ids = eval_ids(params, tok, workdir)
    extra = {f"{g}@{name}": CEDModeBRuntime(model, plan, g, dataclasses.replace(main, projector=head),
                                            kv_format=params.kv_format)
             for name, (head, _) in heads.items() for g in GROUPS}
    nll = multi_group_nll(model, plan, ["baseline"], None, ids, [0] * len(ids), params.eval_ppl.batch_size,
                          tok.pad_token_id, kv_format=params.kv_format, agreement=True, extra=extra,
                          block_tokens=params.eval_ppl.score_block_tokens)
    deltas = paired_deltas({g: v[:, :2].numpy() for g, v in nll.items()}, "delta_ppl_pct", params.seed)
    rows = {}
    for name, (_, row) in heads.items():
        for g in GROUPS:
            label = f"{g}@{name}"
            row |= {f"{g}_dppl_pct": deltas[label]["value"], f"{g}_dppl_pct_ci95": deltas[label]["ci95"],
                    **{f"{g}_{k}": v for k, v in agreement(nll[label], params.seed).items()}}
        rows[name] = row
    base = nll["baseline"][:, :2].sum(0)
    return {
        "protocol": {
            "model": params.model.name, "data": params.data.name, "dtype": str(model.dtype).removeprefix("torch."),
            "layer": plan.source, "split": plan.split, "records": len(ids), "tokens_scored": int(base[1]),
            "baseline_ppl": math.exp(float(base[0] / base[1])),
            "fit": "held-out rows of the dump's validation records (train_projector's split), float32",
            "train": dataclasses.asdict(study.train) | {"optimizer": "AdamW over the MLP only, warm-up + cosine; the "
                                                        "base frozen at the ridge map; best held-out epoch kept"},
            "ppl": "the pipeline's eval records, teacher-forced, Mode B; paired bootstrap 95% CI over records",
            "ced_csa2": "the main branch's adapters (models/adapters.pt) on the projected source",
            "command": "dvc repro studies/dvc.yaml (python studies/projector_head.py)",
        },
        "heads": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def markdown(m: dict) -> str:
    p = m["protocol"]
    lines = [f"CED projector heads for layer {p['layer']} (from H_{p['split']}) on {p['model']} ({p['dtype']}): "
             f"{p['records']} eval records, {p['tokens_scored']:,} scored tokens; not a Qwen3.5-4B result.", "",
             "| head | parameters | extra MACs/token | held-out R² K / V | kept epoch | ced ΔPPL % [95% CI] | "
             "ced KL | ced_csa2 ΔPPL % [95% CI] | ced_csa2 KL | train s |",
             "|---|---:|---:|---|---:|---|---:|---|---:|---:|"]
    for name, r in m["heads"].items():
        cells = [f"{r['parameters']:,}", f"{r['extra_macs_per_token']:,}", f"{r['r2_k']:.4f} / {r['r2_v']:.4f}",
                 str(r["kept_epoch"])]
        for g in GROUPS:
            lo, hi = r[f"{g}_dppl_pct_ci95"]
            cells += [f"{r[f'{g}_dppl_pct']:+.2f} [{lo:+.2f}, {hi:+.2f}]", f"{r[f'{g}_kl']:.4f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {r['train_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    params = load_params(Path("params.yaml"))
    check_prepared(params, Path("."), EVAL_JSONL)
    metrics = run(params, load_study())
    write_json(OUT / "metrics.json", metrics)
    atomic_write_text(OUT / "heads.md", markdown(metrics))
    log.info("done in %.0f s:\n%s", metrics["seconds"], markdown(metrics))


if __name__ == "__main__":
    run_study(main)
