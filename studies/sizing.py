"""How big must the embedded default be?  Two curves, measured on one dump.

    python studies/sizing.py --workdir <repo with data/dump/dump.h5 and data/corpus/eval.jsonl>

1. **Ridge held-out R² against training rows.**  The closed-form maps of the ridge stage
   (``proj_<source>`` K and V halves, ``k_<t>``, ``v_<t>``) fitted on the first ``n`` train
   records of a seeded order, scored on the fixed validation records of the dump's split.
   Where R² stops moving is the dump size the default needs.
2. **Half-width of the ΔPPL 95% CI against eval tokens.**  With the maps fitted on all
   train rows, every Mode B group's per-record NLL on the eval records; for the first ``n``
   records of a seeded order, the paired bootstrap interval of ΔPPL % vs baseline
   (:func:`ced_csa2.eval.stats.paired_bootstrap`).  How many eval tokens a ΔPPL needs to be
   told apart from its neighbours.

Writes ``studies/sizing/{ridge_r2_vs_rows,dppl_ci_vs_eval_tokens}.tsv`` (declared as plots
in dvc.yaml) and ``studies/sizing/per_record_nll.json`` (the raw per-record sums).
Uses the workdir's ``params.yaml`` (model, plan, split, ridge.lambda, kv_format).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ced_csa2.ced_runtime import CEDModeBRuntime
from ced_csa2.config import load_params
from ced_csa2.data.dump_file import DumpReader
from ced_csa2.data.loader import aligned_block_rows, record_split, row_mask
from ced_csa2.data.records import check_prepared, read_records, tokenize
from ced_csa2.eval.scoring import sequence_nll
from ced_csa2.eval.stats import paired_bootstrap
from ced_csa2.maps.ridge import evaluate_maps, fit_maps, map_groups, save_ridge
from ced_csa2.model_utils import load_model_and_tokenizer
from ced_csa2.pipeline.atomic_files import atomic_write_text, write_tsv
from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.paths import DUMP_PATH, EVAL_JSONL
from ced_csa2.pipeline.study_runner import run_study
from ced_csa2.plan import load_plan
from ced_csa2.groups import GROUP_NAMES
from ced_csa2.train.objectives import ridge_parts

OUT = Path(__file__).resolve().parent / "sizing"
log = logging.getLogger("sizing")


def ridge_curve(workdir: Path, params, plan, sizes: list[int]) -> tuple[list[dict], dict]:
    groups = map_groups(plan)
    with DumpReader(workdir / DUMP_PATH) as reader:
        train, val = record_split(reader.n_records, params.split.val_fraction, params.seed)
        order = np.random.default_rng(params.seed).permutation(train)
        val_mask = row_mask(reader.record_offsets, val, 0, params.seed)
        block = aligned_block_rows(reader, params.ridge.block_rows)
        rows, maps = [], None
        for n in [s for s in sizes if s < len(order)] + [len(order)]:
            mask = row_mask(reader.record_offsets, np.sort(order[:n]), 0, params.seed)
            maps = fit_maps(reader, groups, mask, block, params.ridge.lam)
            fits = evaluate_maps(reader, groups, maps, val_mask, block)
            row = {"train_records": n, "train_rows": int(mask.sum())}
            row.update({f"r2_{name}": fits[name]["r2"] for name in sorted(fits) if name != f"proj_{plan.source}"})
            rows.append(row)
            log.info("%d records, %d rows: %s", n, row["train_rows"],
                     {k: round(v, 4) for k, v in row.items() if k.startswith("r2")})
    return rows, maps


def ci_curve(workdir: Path, params, plan, geo, maps: dict, sizes: list[int], groups: list[str]
             ) -> tuple[list[dict], dict]:
    """Per-record NLL of every group (maps at the ridge solution) and the CI half-width per eval size."""
    with tempfile.TemporaryDirectory() as tmp:
        save_ridge(Path(tmp) / "ridge.pt", maps, {})
        parts = ridge_parts(params, plan, geo, Path(tmp) / "ridge.pt")
    model, tok = load_model_and_tokenizer(params.model)
    ids = tokenize(tok, read_records(workdir / EVAL_JSONL), params.data.max_tokens)
    nll = {}
    for group in ["baseline", *groups]:
        t0 = time.perf_counter()
        with CEDModeBRuntime(model, plan, group, parts, kv_format=params.kv_format):
            nll[group] = sequence_nll(model, ids, [0] * len(ids), 8, tok.pad_token_id,
                                      block_tokens=params.eval_ppl.score_block_tokens).numpy()
        log.info("%s: %.1f s, ppl %.3f", group, time.perf_counter() - t0, np.exp(nll[group][:, 0].sum() / nll[group][:, 1].sum()))
    order = np.random.default_rng(params.seed).permutation(len(ids))
    rows = []
    for n in [s for s in sizes if s < len(ids)] + [len(ids)]:
        pick = np.sort(order[:n])
        row = {"eval_records": n, "eval_tokens": int(nll["baseline"][pick, 1].sum())}
        for group in groups:
            ci = paired_bootstrap(nll[group][pick], nll["baseline"][pick], seed=params.seed)["ci95"]
            row[f"halfwidth_{group}"] = (ci[1] - ci[0]) / 2
        rows.append(row)
        log.info("%s", row)
    return rows, {"dtype": str(model.dtype).removeprefix("torch."), "nll": {g: v.tolist() for g, v in nll.items()}}


def arguments() -> ArgumentParser:
    ap = ArgumentParser(prog="python studies/sizing.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--ridge-sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128, 192])
    ap.add_argument("--eval-sizes", type=int, nargs="+", default=[10, 20, 30, 40, 50, 60, 70, 80, 90])
    ap.add_argument("--groups", nargs="+", default=["ced", "csa2"], choices=GROUP_NAMES[1:],
                    help="groups whose ΔPPL CI is measured (each costs one pass over the eval records)")
    return ap


def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    params = load_params(args.workdir / "params.yaml")
    check_prepared(params, args.workdir, EVAL_JSONL)
    plan, geo = load_plan(params.plan, params.model)
    torch.manual_seed(params.seed)
    ridge_rows, maps = ridge_curve(args.workdir, params, plan, args.ridge_sizes)
    write_tsv(OUT / "ridge_r2_vs_rows.tsv", ridge_rows)
    ci_rows, scored = ci_curve(args.workdir, params, plan, geo, maps, args.eval_sizes, args.groups)
    write_tsv(OUT / "dppl_ci_vs_eval_tokens.tsv", ci_rows)
    protocol = {"model": params.model.name, "data": params.data.name, "dtype": scored["dtype"],
                "plan": [plan.split, plan.source, list(plan.targets)], "kv_format": params.kv_format,
                "maps": f"ridge (lambda {params.ridge.lam:g}) on all train records of the dump"}
    atomic_write_text(OUT / "per_record_nll.json", json.dumps({"protocol": protocol, "nll": scored["nll"]}))


if __name__ == "__main__":
    run_study(main, arguments())
