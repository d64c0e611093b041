"""``eval_gsm8k`` stage: GSM8K exact match of the generated groups and Mode A, gold-answer NLL of every group.

    python -m ced_csa2.stages.eval_gsm8k        # what `dvc repro eval_gsm8k` runs

The protocol (lm-eval's own ``gsm8k`` task on ``data/gsm8k.jsonl``, gold NLL on the prompts
of ``data/gsm8k_gold.json``, Mode A through ``ModeALM``, data parallelism) is
:mod:`ced_csa2.eval.gsm8k`'s.  Writes ``metrics/gsm8k.json``:
``{"protocol": {...}, "groups": {group: {...}}, "mode_a": {...}}``; generation times go to
``timings/eval_gsm8k.json``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

from ..ced_runtime import CEDParts, load_mode_a_parts, load_parts
from ..config import Params
from ..data.records import check_prepared
from ..eval.gsm8k import (
    check_chat_template,
    count_problems,
    generate_groups,
    go_offline,
    groups_gold_nll,
    load_gold_pairs,
    local_task,
    mode_a_arm,
    run_protocol,
)
from ..model_utils import load_model_and_tokenizer, resolve_device
from ..pipeline import distributed
from ..pipeline.atomic_files import write_json
from ..pipeline.map_roles import MAIN
from ..pipeline.paths import GOLD_PATH, GSM8K_JSONL, MODELS
from ..pipeline.paths import GSM8K_METRICS as METRICS_PATH
from ..pipeline.stage_runner import record_timing, run_stage, stage_arguments
from ..plan import load_plan
from ..groups import GROUPS

log = logging.getLogger(__name__)



def run(params: Params, workdir: Path = Path("."), *, parts: CEDParts | None = None,
        model_and_tok=None) -> dict:
    """Evaluate every group and write ``metrics/gsm8k.json``; returns what it wrote (rank 0 writes).

    Parameters
    ----------
    params
        Validated parameters (``seed``, ``model``, ``plan``, ``data.math.label`` with ``data.mix_math_templates``, ``eval_gsm8k``).
    workdir
        Repository root holding ``data/`` and ``models/``.
    parts
        Trained maps; loaded from ``workdir/models`` when ``None`` and a group needs them,
        each checked by :func:`ced_csa2.ced_runtime.load_parts` against the model, plan and geometry.
    model_and_tok
        ``(model, tokenizer)`` to use instead of loading ``params.model`` (tests).
    """
    with distributed.session(params.distributed):
        return _run(params, Path(workdir), parts, model_and_tok)


def _run(params: Params, workdir: Path, parts: CEDParts | None, model_and_tok) -> dict:
    go_offline()
    from lm_eval import __version__ as lm_eval_version

    from ..eval.lm_eval_models import DataParallelLM  # imports lm-eval: after go_offline()

    cfg = params.eval_gsm8k
    check_prepared(params, workdir, GSM8K_JSONL)
    data_file = workdir / GSM8K_JSONL
    n = count_problems(data_file)
    pairs = load_gold_pairs(workdir / GOLD_PATH, params, n)
    plan, geo = load_plan(params.plan, params.model)
    model, tok = model_and_tok or load_model_and_tokenizer(
        params.model, device=distributed.local_device(resolve_device(cfg.device)))
    low_rank = any(GROUPS[g].low_rank for g in cfg.groups)  # xkv: models/xkv.pt
    given = parts
    if parts is None and (any(GROUPS[g].uses_maps for g in cfg.groups) or low_rank):
        parts = load_parts(workdir / MODELS, params, plan, geo, role=MAIN, device=model.device,
                           low_rank=low_rank)
    check_chat_template(tok, params)
    lm = DataParallelLM(pretrained=model, tokenizer=tok, batch_size=cfg.batch_size)
    log.info("GSM8K (%s, %d problems, %d-shot, max_gen_toks %d): generation for %s, gold NLL for %s",
             params.data.math_label(), n, cfg.num_fewshot, cfg.max_gen_toks, list(cfg.generate), list(cfg.groups))

    with local_task(data_file, cfg.num_fewshot) as task_manager:
        groups, generation_s = generate_groups(lm, model, plan, parts, task_manager, params, pairs, n)
        mode_a_parts = parts if given is not None or plan.uncovered(geo) or cfg.mode_a == "off" else \
            load_mode_a_parts(workdir, params, plan, geo, device=model.device)
        mode_a, more = mode_a_arm(params, model, tok, plan, geo, mode_a_parts, task_manager, pairs)
        if mode_a["covered"]:
            mode_a["maps"] = "given" if given is not None else params.mode_a.maps
    # Gold NLL of every group on the prompts lm-eval built, all groups at once (shared trunk).
    t0 = time.perf_counter()
    gold = groups_gold_nll(model, plan, list(cfg.groups), parts, pairs, cfg.batch_size, tok.pad_token_id,
                           kv_format=params.kv_format, seed=params.seed, more=more,
                           block_tokens=params.eval_ppl.score_block_tokens)
    for group in cfg.groups:
        groups[group]["gold_nll"] = gold[group]
        log.info("%s: gold NLL %.4f/token", group, gold[group]["nll_per_token"])
    record_timing(generation_s=generation_s, gold_nll_s=round(time.perf_counter() - t0, 1),
                  mode_a_generation_s=mode_a.pop("seconds", None))
    log.info("gold NLL of %d groups: %.1f s", len(cfg.groups), time.perf_counter() - t0)
    if more:
        mode_a["gold_nll"] = gold["mode_a"]

    metrics = {"protocol": run_protocol(params, model, plan, n, lm_eval_version), "groups": groups, "mode_a": mode_a}
    if distributed.is_main():
        write_json(workdir / METRICS_PATH, metrics)
    return metrics


def main(argv: Sequence[str] | None = None) -> None:
    run_stage(run, *stage_arguments(run, argv), launcher=distributed.relaunch)


if __name__ == "__main__":
    main()
