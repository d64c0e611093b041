"""The seed's projector recipe, diagnosed: what its open choice (batch size, hence steps) does.

    dvc repro studies/dvc.yaml       # runs: python studies/projector_recipe.py

The seed fixes the projector's optimiser (AdamW, lr 2e-3, warm-up + cosine, 12 epochs) and
leaves the batch size open.  At a fixed number of epochs the batch size sets the number of
optimizer steps, and on the embedded dump that is what decides whether the projector
learns anything: this study trains the source layer's projector with the seed's fixed
choices at several batch sizes, from PyTorch's default init (``init: random``, the seed's)
and from the ridge map (``init: ridge``), and scores each on

* held-out K and V R² (every token of the dump's validation records), and
* ΔPPL % of the ``ced`` group against the baseline on the pipeline's eval records (paired
  bootstrap 95% CI over records; the same corpus-level PPL ``eval_ppl`` reports),

next to the closed-form ridge map (the same rows, no training).  Everything else comes from
``params.yaml`` (model, plan, split, seed, ``train_projector`` except ``batch_size`` /
``init``, ``eval_ppl.records``).

Writes ``studies/projector_recipe/init_{random,ridge}.tsv`` (one row per batch size, in
decreasing order, i.e. increasing steps; plotted by ``dvc plots show``, declared in
``dvc.yaml``) and ``studies/projector_recipe/sweep.png`` (both against steps, for README).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from pathlib import Path

from ced_csa2.ced_runtime import CEDParts
from ced_csa2.config import load_params
from ced_csa2.data.records import check_prepared
from ced_csa2.eval.perplexity import eval_ids
from ced_csa2.eval.scoring import multi_group_nll
from ced_csa2.eval.stats import paired_bootstrap
from ced_csa2.model_utils import load_model_and_tokenizer, resolve_device
from ced_csa2.pipeline.atomic_files import write_tsv
from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.figures import write_png
from ced_csa2.pipeline.paths import DUMP_PATH, EVAL_JSONL, RIDGE_PATH
from ced_csa2.pipeline.study_runner import run_study
from ced_csa2.plan import load_plan
from ced_csa2.train.projector_training import ridge_fitted, train_projectors
from ced_csa2.train.training import split_masks

OUT = Path("studies/projector_recipe")
BATCH_SIZES = {"random": (4096, 2048, 1024, 512, 256, 128, 64),
               "ridge": (4096, 256)}  # from the ridge map: already at the MSE optimum, two points suffice
log = logging.getLogger("projector_recipe")


def plot(results: dict[str, list[dict]], path: Path) -> None:
    """Held-out R² and ced ΔPPL against optimizer steps, per init, with the ridge map's as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (r2, dppl) = plt.subplots(1, 2, figsize=(10, 3.8))
    ref = results["random"][0]
    for init, rows in results.items():
        steps = [r["steps"] for r in rows]
        for kind, marker in (("k", "o"), ("v", "s")):
            r2.plot(steps, [max(r[f"r2_{kind}"], -1.0) for r in rows], marker=marker,
                    label=f"{kind.upper()}, init {init}")
        dppl.errorbar(steps, [r["dppl_pct"] for r in rows], marker="o", label=f"init {init}", capsize=3,
                      yerr=[[r["dppl_pct"] - r["dppl_ci_low"] for r in rows],
                            [r["dppl_ci_high"] - r["dppl_pct"] for r in rows]])
    for kind, style in (("k", "--"), ("v", ":")):
        r2.axhline(ref[f"ridge_r2_{kind}"], color="gray", linestyle=style, label=f"{kind.upper()}, ridge map")
    dppl.axhline(ref["ridge_dppl_pct"], color="gray", linestyle="--", label="ridge map")
    for ax in (r2, dppl):
        ax.set_xscale("log")
        ax.set_xlabel(f"optimizer steps ({ref['epochs']} epochs of {ref['train_rows']:,} rows; batch size varies)")
        ax.legend(fontsize=7)
    r2.set_ylabel("held-out R² (clipped at -1)")
    dppl.set_yscale("log")
    dppl.set_ylabel("ced ΔPPL % vs baseline [95% CI]")
    fig.suptitle("The seed's projector recipe (AdamW lr 2e-3, cosine) against its open batch size")
    write_png(fig, path)


def batch_sizes(text: str) -> list[int]:
    """``--<init>-batch-sizes 4096,256`` as ``[4096, 256]``; anything else is argparse's error, before any work."""
    try:
        sizes = [int(size) for size in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers")
    return sizes


def arguments() -> ArgumentParser:
    ap = ArgumentParser(prog="python studies/projector_recipe.py", description=__doc__.split("\n\n")[0])
    for init, sizes in BATCH_SIZES.items():
        ap.add_argument(f"--{init}-batch-sizes", type=batch_sizes, default=list(sizes), metavar="N,N,...")
    return ap


def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    params = load_params(Path("params.yaml"))
    check_prepared(params, Path("."), EVAL_JSONL)
    plan, geo = load_plan(params.plan, params.model)
    train_mask, val_mask = split_masks(DUMP_PATH, params, plan, geo, [plan.source], tokens_per_record=0)
    model, tok = load_model_and_tokenizer(params.model, device=resolve_device(params.eval_ppl.device))
    ids = eval_ids(params, tok, Path("."))

    # The baseline once; each setting's ced only from its branch point (the source layer) on.
    def nll(group: str, parts: CEDParts | None):
        return multi_group_nll(model, plan, [group], parts, ids, [0] * len(ids), params.eval_ppl.batch_size,
                               tok.pad_token_id, kv_format=params.kv_format,
                               block_tokens=params.eval_ppl.score_block_tokens)[group].numpy()

    base = nll("baseline", None)

    def ced_ppl(projector) -> dict:
        d = paired_bootstrap(nll("ced", CEDParts(projector=projector)), base, "delta_ppl_pct", seed=params.seed)
        return {"dppl_pct": d["value"], "dppl_ci_low": d["ci95"][0], "dppl_ci_high": d["ci95"][1]}

    ridge = ridge_fitted(params, DUMP_PATH, RIDGE_PATH, [plan.source], geo, val_mask, 4096)
    reference = ridge.layers[plan.source]
    ridge_row = {"ridge_r2_k": reference["k"]["r2"], "ridge_r2_v": reference["v"]["r2"],
                 **{f"ridge_{k}": v for k, v in ced_ppl(ridge.projectors[plan.source]).items()}}
    log.info("ridge map: %s", ridge_row)
    results: dict[str, list[dict]] = {}
    for init in ("random", "ridge"):
        rows = results[init] = []
        for batch in getattr(args, f"{init}_batch_sizes"):
            # keep: last -- the recipe as the seed runs it (the main branch keeps its best held-out epoch)
            recipe = dataclasses.replace(params.train_projector, batch_size=batch, init=init, keep="last")
            t0 = time.perf_counter()
            fitted = train_projectors(params, DUMP_PATH, (plan.source,), geo, train_mask, val_mask,
                                      desc=f"{init} batch {batch}", ridge=RIDGE_PATH, cfg=recipe)
            wall = time.perf_counter() - t0
            m = fitted.layers[plan.source]
            row = {"init": init, "batch_size": batch, "epochs": recipe.epochs, "steps": fitted.run["steps"],
                   "train_rows": fitted.run["train_rows"], "val_rows": fitted.run["val_rows"],
                   "r2_k": m["k"]["r2"], "r2_v": m["v"]["r2"], **ced_ppl(fitted.projectors[plan.source]),
                   "train_wall_s": round(wall, 2), **ridge_row}
            log.info("%s", row)
            rows.append(row)
            write_tsv(OUT / f"init_{init}.tsv", rows)  # after every setting: a long sweep shows its progress
    plot(results, OUT / "sweep.png")


if __name__ == "__main__":
    run_study(main, arguments())
