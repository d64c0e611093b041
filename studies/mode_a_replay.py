"""Mode A's bounded replay: what replaying the last prompt tokens buys back, and what it costs in speed.

    dvc repro studies/dvc.yaml       # runs: python studies/mode_a_replay.py

DeepSeek-V4.1 serves compressed prefixes with a bounded replay: the newest tokens are
recomputed exactly, the older ones are read from the compressed store.  Here (covering
plans) the last ``replay`` prefilled tokens also run through the layers above the cut
(``mode_a.replay``, :class:`~ced_csa2.ced_runtime.CEDModeARuntime`): their own K/V there,
and the non-attention layers' state built from them.  For every pair of

* maps: ``ridge`` (the closed-form maps of ``models/ridge.pt``, untrained: the source's and
  the extra sources' projectors, the adapters at their ridge bases) and ``trained``
  (stage ``tune_mode_a``'s, trained through the pure skip), and
* replay: 0 (the seed's pure skip), 16, 64, 128 tokens, and
* sink: ``none`` (the maps serve the first position too: the seed's pure skip) and ``mean`` (the
  first position's K/V above the cut are ``tune_mode_a``'s constants, :class:`~ced_csa2.ced_runtime.SinkKV`),

it measures, with the pipeline's protocols and params (``params.yaml``): Mode A's prefix
ΔPPL %, KL and top-1 against the plain prefill on ``eval_ppl``'s records (prompt = the first
``eval_ppl.prefix_fraction``; paired bootstrap 95% CIs over records), Mode A's gold-answer NLL
on GSM8K (``data/gsm8k_gold.json``, each prompt prefilled by the skip through lm-eval's
``ModeALM``; Δ against the plain model, paired bootstrap over problems), the layer-pass bound
of the prefill speed-up and the measured speed-up (``eval_ppl.timing_records`` seeded prompts:
per-shape warm-up, arms alternated, median of 3; a timing of this machine, refused above the
bound).  Timings of a loaded machine are not comparable: run it alone.

Writes ``studies/mode_a_replay/replay.tsv`` (one row per setting) and ``replay.png``.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

from ced_csa2.ced_runtime import CEDModeARuntime, load_mode_a_parts
from ced_csa2.config import load_params
from ced_csa2.data.records import check_prepared
from ced_csa2.eval.gsm8k import go_offline, groups_gold_nll, load_gold_pairs, mode_a_gold_rows
from ced_csa2.eval.perplexity import eval_ids, mode_a_prefix
from ced_csa2.model_utils import load_model_and_tokenizer, resolve_device
from ced_csa2.pipeline.atomic_files import write_tsv
from ced_csa2.pipeline.figures import write_png
from ced_csa2.pipeline.paths import EVAL_JSONL, GOLD_PATH, RIDGE_PATH
from ced_csa2.pipeline.study_runner import run_study
from ced_csa2.plan import load_plan
from ced_csa2.train.objectives import ridge_parts
from ced_csa2.train.projector_training import ridge_projectors

OUT = Path("studies/mode_a_replay")
REPLAYS = (0, 16, 64, 128)
SINKS = ("none", "mean")
log = logging.getLogger("mode_a_replay")


def plot(rows: list[dict], path: Path) -> None:
    """Prefix ΔPPL (with CIs) and the speed-up (measured and bound) against the replayed tokens, per maps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (quality, speed) = plt.subplots(1, 2, figsize=(10, 3.8))
    for (maps, sink), marker in zip([(m, s) for s in SINKS for m in ("ridge", "trained")], "sodD"):
        mine = [r for r in rows if r["maps"] == maps and r["sink"] == sink]
        x = [r["replay"] for r in mine]
        quality.errorbar(x, [r["dppl_pct"] for r in mine], marker=marker, capsize=3, label=f"{maps} maps, sink {sink}",
                         yerr=[[r["dppl_pct"] - r["dppl_ci_low"] for r in mine],
                               [r["dppl_ci_high"] - r["dppl_pct"] for r in mine]])
        speed.plot(x, [r["speedup"] if r["speedup"] != "" else float("nan") for r in mine], marker=marker,
                   label=f"measured, {maps} maps, sink {sink}")
    bound = [r for r in rows if r["maps"] == "trained" and r["sink"] == SINKS[0]]
    speed.plot([r["replay"] for r in bound], [r["bound"] for r in bound], "k--", label="bound (layer passes)")
    speed.axhline(1.8, color="gray", linestyle=":", label="1.8×")
    quality.set_yscale("log")
    quality.set_ylabel("Mode A prefix ΔPPL % vs plain prefill [95% CI]")
    speed.set_ylabel("prefill speed-up (plain / Mode A)")
    for ax in (quality, speed):
        ax.set_xlabel("replayed prompt tokens (mode_a.replay)")
        ax.legend(fontsize=7)
    fig.suptitle("Mode A with bounded replay: quality and prefill speed-up (embedded default; not Qwen3.5-4B)")
    write_png(fig, path)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    params = load_params(Path("params.yaml"))
    check_prepared(params, Path("."), EVAL_JSONL)
    plan, geo = load_plan(params.plan, params.model)
    plan.require_covering(geo)
    cfg = params.eval_ppl
    model, tok = load_model_and_tokenizer(params.model, device=resolve_device(cfg.device))
    ids = eval_ids(params, tok, Path("."))
    pairs = load_gold_pairs(GOLD_PATH, params)
    trained = load_mode_a_parts(Path("."), params, plan, geo)  # the sink's constants with them (sink: mean)
    ridge = ridge_parts(params, plan, geo, RIDGE_PATH)
    ridge.extra, ridge.sink = ridge_projectors(RIDGE_PATH, list(plan.extra_sources), geo, params), trained.sink
    maps = {"ridge": ridge, "trained": trained}
    go_offline()
    from ced_csa2.eval.lm_eval_models import ModeALM  # imports lm-eval: after go_offline()

    rows, gold_rows = [], {}
    for sink, (name, parts), replay in itertools.product(SINKS, maps.items(), REPLAYS):
        t0 = time.perf_counter()
        a = mode_a_prefix(model, plan, geo, parts, ids, cfg.prefix_fraction, params.seed,
                          timing_records=cfg.timing_records, block_tokens=cfg.score_block_tokens, replay=replay,
                          sink=sink)
        lm = ModeALM(CEDModeARuntime(model, plan, geo, parts, replay=replay, sink=sink), tok,
                     block_tokens=cfg.score_block_tokens)
        label = f"{name}@{replay}@{sink}"
        gold_rows[label] = mode_a_gold_rows(lm, pairs)
        timing = a["timing"]
        rows.append({"maps": name, "sink": sink, "replay": replay, "dppl_pct": a["delta_pct"],
                     "dppl_ci_low": a["delta_pct_ci95"][0], "dppl_ci_high": a["delta_pct_ci95"][1],
                     "kl": a["kl"], "top1_pct": a["top1_pct"], "bound": timing["bound"],
                     "speedup": "" if timing["speedup"] is None else timing["speedup"],
                     "timed_records": timing["records"]})
        log.info("%s: ΔPPL %+.2f%% [%+.2f, %+.2f], KL %.4f, speed-up %s (bound %.2f), %.0f s", label,
                 a["delta_pct"], *a["delta_pct_ci95"], a["kl"], timing["speedup"], timing["bound"],
                 time.perf_counter() - t0)
    # Every arm's gold NLL against the plain model's, one baseline pass, paired over problems.
    gold = groups_gold_nll(model, plan, ["baseline"], None, pairs, params.eval_gsm8k.batch_size, tok.pad_token_id,
                           kv_format=params.kv_format, seed=params.seed, more=gold_rows,
                           block_tokens=cfg.score_block_tokens)
    for row in rows:
        g = gold[f"{row['maps']}@{row['replay']}@{row['sink']}"]
        row.update(gold_nll=g["nll_per_token"], dgold_nll=g["delta"], dgold_ci_low=g["delta_ci95"][0],
                   dgold_ci_high=g["delta_ci95"][1])
    rows = [{**r, "records": len(ids), "problems": len(pairs)} for r in rows]
    write_tsv(OUT / "replay.tsv", rows)
    plot(rows, OUT / "replay.png")


if __name__ == "__main__":
    run_study(main)
