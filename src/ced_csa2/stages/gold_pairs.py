"""``gold_pairs`` stage: the tokenised GSM8K gold answers after lm-eval's prompts, without a model.

    python -m ced_csa2.stages.gold_pairs        # what `dvc repro gold_pairs` runs

For each problem of ``data/gsm8k.jsonl``, in file order: the prompt lm-eval's ``gsm8k``
task builds for it (the local task of :mod:`ced_csa2.stages.eval_gsm8k`, with
``eval_gsm8k.num_fewshot`` exemplars and seed ``seed``), lm-eval's target delimiter and the
gold ``answer``, tokenised by the model's tokenizer as lm-eval's ``HFLM`` tokenises
loglikelihood requests (:func:`ced_csa2.eval.gsm8k.prompt_pairs`).  Only the tokenizer is
loaded: no forward pass, seconds on any machine.

Writes ``data/gsm8k_gold.json``: ``{"model", "math_set", "num_fewshot", "pairs"}`` with
``[ids, context_length]`` per problem.  ``eval_gsm8k`` scores gold NLL on these pairs (and
checks that the prompts lm-eval generates from are the same), ``eval_objectives``
too, so the objectives' evaluation never waits on generation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from ..config import Params
from ..data.records import check_prepared
from ..eval.gsm8k import check_chat_template, count_problems, go_offline, local_task, prompt_pairs, write_gold_pairs
from ..model_utils import load_tokenizer
from ..pipeline.paths import GOLD_PATH, GSM8K_JSONL
from ..pipeline.stage_runner import run_stage, stage_arguments

log = logging.getLogger(__name__)


def run(params: Params, workdir: Path = Path(".")) -> list[tuple[list[int], int]]:
    """Write ``data/gsm8k_gold.json`` under ``workdir``; returns its pairs."""
    go_offline()
    workdir, num_fewshot = Path(workdir), params.eval_gsm8k.num_fewshot
    check_prepared(params, workdir, GSM8K_JSONL)
    data_file = workdir / GSM8K_JSONL
    n = count_problems(data_file)
    tokenizer = load_tokenizer(params.model)
    check_chat_template(tokenizer, params)
    with local_task(data_file, num_fewshot) as task_manager:
        pairs = prompt_pairs(tokenizer, task_manager, params)
    if len(pairs) != n:
        raise RuntimeError(f"lm-eval built {len(pairs)} prompts for the {n} problems of {data_file}")
    write_gold_pairs(workdir / GOLD_PATH, params, pairs)
    log.info("%d %s gold pairs (%d-shot): %d answer tokens", n, params.data.math_label(), num_fewshot,
             sum(len(ids) - cut for ids, cut in pairs))
    return pairs


def main(argv: Sequence[str] | None = None) -> None:
    run_stage(run, *stage_arguments(run, argv))


if __name__ == "__main__":
    main()
