"""``report`` stage: the results table and plots from ``metrics/*.json``.

    python -m ced_csa2.stages.report            # what `dvc repro report` runs

Writes ``reports/results.md`` (group x PPL, ΔPPL %, KL to the baseline and top-1 agreement,
GSM8K exact match with Wilson 95% interval, gold-solution NLL, KV bytes/token and
compression, each with its protocol line; Mode A against the plain prefill with its
prefill speed-up; then one row per (group, training objective) of ``train.objectives``
next to the seed's ``kv_mse`` and ``share_plain``),
``reports/{ppl_by_group,adapter_cosine,bytes_vs_ppl}.png``, the headline numbers
``metrics/summary.json`` (:func:`summary`: the DVC metrics) and every group's numbers with
their intervals, ``metrics/groups.tsv`` (:func:`groups_table`: a DVC plot).  Every
figure names its model and data: the embedded default's numbers are SmolLM2-135M on a
Wikipedia sample, not Qwen3.5-4B results.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..config import Params
from ..eval.results import (
    BASES,
    CED_CSA2_START,
    KEPT,
    _kept,
    _load,
    fit_table,
    group_rows,
    groups_table,
    mode_a_table,
    objective_table,
    plots,
    protocol_line,
    results_table,
    served_fit_table,
    summary,
    window_line,
)
from ..pipeline.entry import run_stage
from ..pipeline.io_utils import atomic_write_text, write_json, write_tsv
from ..pipeline.paths import GROUPS_TABLE, OBJECTIVES_EVAL, REPORTS, SEED_INIT, SUMMARY

log = logging.getLogger(__name__)


def run(params: Params, workdir: Path = Path(".")) -> str:
    workdir = Path(workdir)
    ppl, gsm, storage = (_load(workdir, n) for n in ("ppl", "gsm8k", "storage"))
    ridge, projector, adapters = (_load(workdir, n) for n in ("ridge", "projector", "adapters"))
    evals = _load(workdir, Path("objectives") / "eval")
    missing = [o for o in params.train.objectives if o not in evals.get("objectives", {})]
    if missing or SEED_INIT not in evals:
        missing = missing or [SEED_INIT]
        raise ValueError(f"{workdir / OBJECTIVES_EVAL} has no scores for objectives {missing}: "
                         "run `dvc repro eval_objectives`")
    objectives = {o: {"train": _load(workdir, Path("objectives") / o / "train"),
                      "eval": {"protocol": evals["protocol"], **evals["objectives"][o]}} for o in params.train.objectives}
    groups = params.train.eval_groups
    windows = window_line(storage)
    text = "\n".join([
        "# Results", "", protocol_line(ppl, gsm), "", *([windows, ""] if windows else []),
        *results_table(ppl, gsm, storage), "",
        "## Mode A: true CED (prefill skip)", "", *mode_a_table(ppl, gsm, _load(workdir, Path("mode_a") / "train")), "",
        "## Training objectives", "",
        "Same PPL and gold-NLL protocols as above; Δ against the baseline. `kv_mse (seed)` is the main "
        f"branch (projector from {projector['run']['init']} init, batch "
        f"{projector['run']['batch_size']}, {projector['run']['steps']:,} AdamW steps, "
        f"{KEPT[projector['run']['keep']]} (kept: epoch {_kept(projector)}); adapters from ridge on the true "
        f"source K/V, {KEPT[adapters['run']['keep']]} (kept epochs {_kept(adapters)}); K/V MSE); "
        "`kv_mse, random init` is the seed's projector recipe read literally (PyTorch's init, the last "
        "epoch), for `ced`; every other objective starts from the ridge maps (`ridge` = "
        "that start, untrained) and gives each group the maps made for it: `ced_csa2` gets its own projector "
        f"and adapters (starting from {CED_CSA2_START[params.train.ced_csa2_start]}), trained jointly under "
        "`ced_csa2` by the online objectives. Optimizer steps: for `kv_mse` the projector's AdamW and the "
        "adapters' SGD steps over dumped K/V rows; for the online objectives the steps and tokens of their "
        "phases (ced, csa2, ced_csa2; metrics/objectives/*/train.json). Wall times of every stage: "
        "`timings/<stage>.json` after a run.", "",
        *objective_table(ppl, gsm, projector, adapters, objectives, evals[SEED_INIT], groups), "",
        "## Fit of the maps (held-out tokens)", "", *fit_table(ridge, projector, adapters), "",
        *served_fit_table(ridge, list(adapters["layers"]), params.train_adapters.input), "",
        "Qwen3.5-4B geometry (computed from its config, no weights): "
        + ", ".join(f"{b}: baseline {storage['qwen3_5_4b']['kv']['bf16'][b]['baseline']['bytes_per_token']:,.0f} → "
                    f"csa2 {storage['qwen3_5_4b']['kv']['bf16'][b]['csa2']['bytes_per_token']:,.0f} B/token"
                    for b in BASES) + ".", "",
        f"_{storage['note']}_", "",
        "![PPL by group](ppl_by_group.png) ![adapter cosine](adapter_cosine.png) ![bytes vs PPL](bytes_vs_ppl.png)", "",
    ])
    out = workdir / REPORTS
    plots(out, ppl, adapters, storage)
    atomic_write_text(out / "results.md", text)
    rows = group_rows(ppl, gsm, storage, objectives | {SEED_INIT: {"eval": {"groups": evals[SEED_INIT]}}}, groups)
    write_json(workdir / SUMMARY, summary(rows))
    write_tsv(workdir / GROUPS_TABLE, groups_table(rows))
    log.info("wrote %s, %s and %s", out / "results.md", workdir / SUMMARY, workdir / GROUPS_TABLE)
    return text


def main() -> None:
    run_stage(run)


if __name__ == "__main__":
    main()
