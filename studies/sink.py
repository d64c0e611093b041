"""The attention sink in Mode B: what keeping the first position's K/V buys each group.

    dvc repro studies/dvc.yaml       # runs: python studies/sink.py

Mode A lost most of its quality at one position: the first, the attention sink, whose K/V above
the cut no map of ``H_split`` reproduces (``mode_a.sink``, ``docs/results.md``).  Mode B's groups
replace K/V at every position too, the first included.  For every group below and each maps set
(``main``: the main branch's, ``models/``; ``attn_out``: the ``tune@attn_out`` branch's, each group
its own), scored on ``eval_ppl``'s records with its protocol (teacher-forced, one shared trunk,
paired bootstrap 95% intervals over records against one baseline pass):

* ``none``: the group as the pipeline scores it;
* ``exact``: in every layer the group replaces, the first position keeps the plain model's K/V
  (:class:`~ced_csa2.runtime.sink.SinkGroup`; for CSA2 one more entry per target layer per
  sequence: 3 x 2 x kv_dim values, whatever the length; for CED the source's ``k_proj``/``v_proj``
  on one token);
* ``mean``: the first position's K/V are ``tune_mode_a``'s constants (``models/mode_a/sink.pt``:
  the mean over 64 training records' first positions; nothing stored or computed per sequence);
  only where the constants cover every replaced layer (not the every-layer FP4 baseline);
* ``exact`` over the first four positions: StreamingLLM's number of sink tokens (one record of the
  embedded corpus carries a massive activation at position 1).

Writes ``studies/sink/sink.tsv`` (one row per group, maps, sink and positions kept) and ``sink.png``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ced_csa2.ced_runtime import CEDModeBRuntime, load_objective_parts, load_parts, load_sink
from ced_csa2.config import load_params
from ced_csa2.data.records import check_prepared
from ced_csa2.eval.perplexity import eval_ids, groups_ppl
from ced_csa2.model_utils import load_model_and_tokenizer, resolve_device
from ced_csa2.pipeline.atomic_files import write_tsv
from ced_csa2.pipeline.checkpoint import check_meta_provenance, expected_meta
from ced_csa2.pipeline.figures import write_png
from ced_csa2.pipeline.map_roles import MAIN, MODE_A
from ced_csa2.pipeline.paths import EVAL_JSONL, MODE_A_SINK, MODELS
from ced_csa2.pipeline.study_runner import run_study
from ced_csa2.plan import load_plan
from ced_csa2.runtime.sink import SinkGroup

OUT = Path("studies/sink")
GROUPS = {"main": ("ced", "csa2", "ced_csa2", "baseline_fp4_rot", "csa2_fp4_rot", "ced_csa2_fp4_rot"),
          "attn_out": ("ced", "csa2", "ced_csa2")}
STREAMING_SINKS = 4  # StreamingLLM (Xiao et al., 2024) keeps the first four tokens
# (sink, positions kept): the group as the pipeline scores it, then each way of keeping the sink
SETTINGS = (("none", 0), ("exact", 1), ("mean", 1), ("exact", STREAMING_SINKS))
log = logging.getLogger("sink")


def plot(rows: list[dict], path: Path) -> None:
    """ΔPPL with its 95% interval per group and maps, one marker per sink setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(f"{r['group']}\n({r['maps']})" for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4))
    for j, ((sink, positions), marker) in enumerate(zip(SETTINGS, "osD^")):
        mine = [r for r in rows if (r["sink"], r["positions"]) == (sink, positions)]
        x = [labels.index(f"{r['group']}\n({r['maps']})") + (j - 1.5) * 0.18 for r in mine]
        y = [r["dppl_pct"] for r in mine]
        ax.errorbar(x, y, yerr=[[r["dppl_pct"] - r["dppl_ci_low"] for r in mine],
                                [r["dppl_ci_high"] - r["dppl_pct"] for r in mine]],
                    fmt=marker, capsize=3, label=f"sink: {sink}" + (f", {positions} positions" if positions > 1 else ""))
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("ΔPPL % vs baseline [95% CI]")
    ax.axhline(0, color="gray", linewidth=0.5)
    ax.legend(fontsize=8)
    ax.set_title("Mode B with the attention sink kept (embedded default; not Qwen3.5-4B)")
    write_png(fig, path)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    params = load_params(Path("params.yaml"))
    check_prepared(params, Path("."), EVAL_JSONL)
    plan, geo = load_plan(params.plan, params.model)
    model, tok = load_model_and_tokenizer(params.model, device=resolve_device(params.eval_ppl.device))
    ids = eval_ids(params, tok, Path("."))
    constants, meta = load_sink(MODE_A_SINK, expected_meta(params, plan, geo)["sink"])
    check_meta_provenance(MODE_A_SINK, meta, params, MODE_A)
    maps = {"main": load_parts(MODELS, params, plan, geo, role=MAIN),
            "attn_out": load_objective_parts(Path("."), "attn_out", params, plan, geo, None)}
    runtimes, keys = {}, {}
    for name, groups in GROUPS.items():
        for group in groups:
            parts = maps[name] if name == "main" else maps[name][group]
            for sink, positions in SETTINGS:
                runtime = CEDModeBRuntime(model, plan, group, parts, kv_format=params.kv_format)
                if sink == "mean" and not set(runtime.replaced_layers) <= set(constants.layers):
                    continue
                label = f"{group}@{name}/{sink}" + (str(positions) if positions > 1 else "")
                runtimes[label] = runtime if sink == "none" else SinkGroup(runtime, sink, constants, positions)
                keys[label] = (group, name, sink, positions)
    scores = groups_ppl(model, plan, ["baseline"], None, ids, params, tok.pad_token_id, extra=runtimes)
    rows = []
    for label, (group, name, sink, positions) in keys.items():
        s = scores[label]
        rows.append({"group": group, "maps": name, "sink": sink, "positions": positions, "dppl_pct": s["delta_pct"],
                     "dppl_ci_low": s["delta_pct_ci95"][0], "dppl_ci_high": s["delta_pct_ci95"][1],
                     "kl": s["kl"], "kl_ci_low": s["kl_ci95"][0], "kl_ci_high": s["kl_ci95"][1],
                     "top1_pct": s["top1_pct"], "records": len(ids), "tokens": s["tokens"]})
        log.info("%s: ΔPPL %+.2f%% [%+.2f, %+.2f], KL %.4f", label, s["delta_pct"], *s["delta_pct_ci95"], s["kl"])
    write_tsv(OUT / "sink.tsv", rows)
    plot(rows, OUT / "sink.png")


if __name__ == "__main__":
    run_study(main)
