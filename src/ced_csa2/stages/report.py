"""``report`` stage: the results table and plots from ``metrics/*.json``.

    python -m ced_csa2.stages.report            # what `dvc repro report` runs

Writes ``reports/results.md`` (group x PPL, ΔPPL %, KL to the baseline and top-1 agreement,
GSM8K exact match with Wilson 95% interval, gold-solution NLL, KV bytes/token and
compression, each with its protocol line; Mode A against the plain prefill with its
prefill speed-up; then one row per (group, training objective) of ``train.objectives``
next to the seed's ``kv_mse`` and ``share_plain``; greedy generation and passkey retrieval through each
group's own cache, from ``metrics/{generation,retrieval}.json``),
``reports/{ppl_by_group,adapter_cosine,bytes_vs_ppl}.png``, the headline numbers
``metrics/summary.json`` (:func:`~ced_csa2.eval.results.summary`: the DVC metrics) and every group's numbers with
their intervals, ``metrics/groups.tsv`` (:func:`~ced_csa2.eval.results.groups_table`: a DVC plot).  Every
figure names its model and data: the embedded default's numbers are SmolLM2-135M on a
Wikipedia sample, not Qwen3.5-4B results.  Result files of another run are refused: the eval stages'
protocols must agree, and their ``kv_format`` (and ``metrics/storage.json``'s) be ``params.yaml``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from ..config import Params
from ..eval.results import build_report, groups_table, plots, summary
from ..pipeline.atomic_files import atomic_write_text, write_json, write_tsv
from ..pipeline.paths import GROUPS_TABLE, REPORTS, SUMMARY
from ..pipeline.stage_runner import run_stage, stage_arguments

log = logging.getLogger(__name__)


def run(params: Params, workdir: Path = Path(".")) -> str:
    workdir = Path(workdir)
    text, rows, figures = build_report(params, workdir)
    out = workdir / REPORTS
    plots(out, *figures)
    atomic_write_text(out / "results.md", text)
    write_json(workdir / SUMMARY, summary(rows))
    write_tsv(workdir / GROUPS_TABLE, groups_table(rows))
    log.info("wrote %s, %s and %s", out / "results.md", workdir / SUMMARY, workdir / GROUPS_TABLE)
    return text


def main(argv: Sequence[str] | None = None) -> None:
    run_stage(run, *stage_arguments(run, argv))


if __name__ == "__main__":
    main()
