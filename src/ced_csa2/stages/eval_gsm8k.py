"""``eval_gsm8k`` stage: GSM8K accuracy of every runtime group through lm-eval, plus gold NLL.

    python -m ced_csa2.stages.eval_gsm8k        # what `dvc repro eval_gsm8k` runs

Protocol.  The problems of ``data/gsm8k.jsonl`` (``data.math.label``: "GSM8K-100" on the
embedded default, never "GSM8K test") are all evaluated, in file order, with lm-eval's
own ``gsm8k`` task: a generated task YAML pulls in the installed ``gsm8k.yaml`` with
``include:``, so its prompt (``"Question: {q}\\nAnswer:"``), stop sequences, greedy
decoding and the ``strict-match`` (``#### N``) and ``flexible-extract`` (last number)
filters are used unchanged; only the data source is replaced (``dataset_path: json``,
the file's single split as test split).  Few-shot exemplars (``eval_gsm8k.num_fewshot``
> 0) never come from the evaluated problems: they are the first ``num_fewshot`` of
lm-eval's inline ``gsm8k-cot`` exemplars, rewritten into GSM8K's ``... \\n#### N`` answer
format.  No chat template.  Generation stops after ``eval_gsm8k.max_gen_toks`` tokens.
Everything runs offline (``HF_HUB_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1``).

The model runs inside :class:`~ced_csa2.ced_runtime.CEDModeBRuntime` (Mode B
substitution; the ``*_fp4`` groups store K/V in ``kv_format``, recorded in the protocol).
For each group of ``eval_gsm8k.generate`` (generation is what GSM8K costs) the stage reports

* per filter (``strict-match``, ``flexible-extract``): ``exact_match``, ``correct``,
  ``n`` and ``ci95`` (Wilson score interval, z = 1.96) (generation times: ``timings/eval_gsm8k.json``);

and for each group of ``eval_gsm8k.groups`` (a superset)

* ``gold_nll`` (``nll_per_token``, ``tokens``; ``delta`` and its paired-bootstrap
  ``delta_ci95`` against baseline): teacher-forced negative log-likelihood per token of
  the gold ``answer`` (after lm-eval's target delimiter ``" "``) given the exact prompt
  lm-eval generated from (few-shot context included), token-weighted over all problems
  and tokenised as lm-eval's loglikelihood requests are: the pairs of
  ``data/gsm8k_gold.json`` (stage ``gold_pairs``; every generated group's prompts are
  checked to be those).  On a small model, accuracy is near zero for every group; this is
  the signal that still moves.  All groups are scored at once with a shared trunk
  (:func:`ced_csa2.eval.scoring.multi_group_nll`).

Mode A (``eval_gsm8k.mode_a``, when the plan covers every attention layer above the cut;
the maps of ``mode_a.maps``, ``mode_a.replay`` tokens replayed):
the same lm-eval task through :class:`~ced_csa2.eval.mode_a_lm.ModeALM` -- each prompt
prefilled by the prefill skip, the answer scored (``gold_nll``: gold NLL, paired against
the baseline) and with ``generate`` also generated (exact match) through all layers -- one
problem at a time (generation: ~1.5 s per problem on 2 CPU cores, 3.6x a batched Mode B group).

Every generated group (and Mode A with ``generate``) also records ``generations_sha256``,
the sha256 of its generated texts in problem order: runs that agree on it generated the
same text for every problem.

Data-parallel (``distributed.nproc``): the stage runs as that many processes (it starts
torchrun itself).  Each runs lm-eval's task whole, but generates only a contiguous share
of the single-process batches (:class:`~ced_csa2.eval.mode_a_lm.DataParallelLM`, which says why
lm-eval's own multi-process path is not used) and the texts are gathered; gold NLL and
Mode A's rows are scored by share and assembled on every rank.  Every batch is the
single-process one, so the metrics are one process's; rank 0 writes.

Writes ``metrics/gsm8k.json``: ``{"protocol": {...}, "groups": {group: {...}}, "mode_a": {...}}``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..ced_runtime import CEDModeARuntime, CEDParts, load_mode_a_parts, load_parts
from ..config import Params
from ..eval.gsm8k import (
    FEWSHOT_SOURCE,
    _offline,
    check_chat_template,
    count_problems,
    evaluate_group,
    evaluate_lm,
    groups_gold_nll,
    load_gold_pairs,
    local_task,
    mode_a_gold_rows,
    prompt_protocol,
)
from ..eval.perplexity import mode_a_note
from ..model_utils import load_model_and_tokenizer, resolve_device
from ..pipeline import distributed
from ..pipeline.entry import record_timing, run_stage
from ..pipeline.io_utils import write_json
from ..pipeline.paths import GOLD_PATH, GSM8K_JSONL, MODELS
from ..pipeline.paths import GSM8K_METRICS as METRICS_PATH
from ..plan import load_plan
from ..runtime.groups import GROUPS

log = logging.getLogger(__name__)



def run(params: Params, workdir: Path = Path("."), *, parts: CEDParts | None = None,
        model_and_tok=None) -> dict:
    """Evaluate every group and write ``metrics/gsm8k.json``; returns what it wrote (rank 0 writes).

    Parameters
    ----------
    params
        Validated parameters (``seed``, ``model``, ``plan``, ``data.math.label``, ``eval_gsm8k``).
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
    _offline()
    from lm_eval import __version__ as lm_eval_version

    from ..eval.mode_a_lm import DataParallelLM  # imports lm-eval: after _offline()

    cfg = params.eval_gsm8k
    data_file = workdir / GSM8K_JSONL
    n = count_problems(data_file)
    pairs = load_gold_pairs(workdir / GOLD_PATH, params)
    plan, geo = load_plan(params.plan, params.model)
    model, tok = model_and_tok or load_model_and_tokenizer(
        params.model, device=distributed.local_device(resolve_device(cfg.device)))
    low_rank = any(GROUPS[g].low_rank for g in cfg.groups)  # xkv: models/xkv.pt
    given = parts
    if parts is None and (any(GROUPS[g].uses_maps for g in cfg.groups) or low_rank):
        parts = load_parts(workdir / MODELS, params, plan, geo, device=model.device, low_rank=low_rank)
    check_chat_template(tok, params)
    lm = DataParallelLM(pretrained=model, tokenizer=tok, batch_size=cfg.batch_size)
    log.info("GSM8K (%s, %d problems, %d-shot, max_gen_toks %d): generation for %s, gold NLL for %s",
             params.data.math.label, n, cfg.num_fewshot, cfg.max_gen_toks, list(cfg.generate), list(cfg.groups))

    groups = {g: {} for g in cfg.groups}
    generation_s = {}  # timings/eval_gsm8k.json
    with local_task(data_file, cfg.num_fewshot) as task_manager:
        for i, group in enumerate(cfg.generate, 1):
            log.info("generation %d/%d: %s", i, len(cfg.generate), group)
            groups[group], group_pairs = evaluate_group(lm, model, plan, group, parts, task_manager, params)
            if not distributed.is_main():
                continue  # lm-eval's results are rank 0's
            if group_pairs != pairs:
                raise RuntimeError(f"lm-eval built different prompts for group {group!r} than {GOLD_PATH} holds")
            g = groups[group]
            generation_s[group] = g.pop("seconds")
            if g["strict-match"]["n"] != n:
                raise RuntimeError(f"lm-eval evaluated {g['strict-match']['n']} problems, expected all {n}")
            log.info("%s: strict-match %d/%d, flexible-extract %d/%d", group, g["strict-match"]["correct"], n,
                     g["flexible-extract"]["correct"], n)
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

    metrics = {
        "protocol": {
            "model": params.model.name, "math_set": params.data.math.label, "n": n,
            "model_revision": params.model.revision, "math_revision": params.data.math.revision,
            **prompt_protocol(params), "fewshot_source": FEWSHOT_SOURCE if cfg.num_fewshot else None,
            "max_gen_toks": cfg.max_gen_toks, "generated_groups": list(cfg.generate), "mode_a": cfg.mode_a,
            "dtype": str(model.dtype).removeprefix("torch."),
            "device": str(model.device), "lm_eval": lm_eval_version, "task": "lm-eval gsm8k.yaml on local data",
            "plan": {"split": plan.split, "source": plan.source, "targets": list(plan.targets)},
            "kv_format": params.kv_format,
        },
        "groups": groups,
        "mode_a": mode_a,
    }
    if distributed.is_main():
        write_json(workdir / METRICS_PATH, metrics)
    return metrics


def mode_a_arm(params: Params, model, tok, plan, geo, parts: CEDParts | None, task_manager, pairs
               ) -> tuple[dict, dict[str, torch.Tensor]]:
    """Mode A's gold-answer rows (and exact match with ``generate``) through :class:`~ced_csa2.eval.mode_a_lm.ModeALM`.

    Returns the metrics entry (``covered: false`` and why, when it does not run) and
    ``{"mode_a": (n, 2) rows}`` for :func:`~ced_csa2.eval.gsm8k.groups_gold_nll` (empty when not run).
    """
    setting = params.eval_gsm8k.mode_a
    if setting == "off":
        return {"covered": None, "note": "eval_gsm8k.mode_a is off"}, {}
    missing = plan.uncovered(geo)
    if missing:
        return {"covered": False, "uncovered_attention_layers": missing,
                "note": f"plan {plan} does not cover every attention layer above the cut; Mode A not run"}, {}
    from ..eval.mode_a_lm import ModeALM

    replay = params.mode_a.replay
    lm = ModeALM(CEDModeARuntime(model, plan, geo, parts, replay=replay), tok,
                 block_tokens=params.eval_ppl.score_block_tokens)
    entry = {}
    if setting == "generate":
        log.info("Mode A: generation through the prefill skip, one problem at a time")
        entry, mode_a_pairs = evaluate_lm(lm, task_manager, params, "mode_a")
        if distributed.is_main() and mode_a_pairs != pairs:
            raise RuntimeError(f"lm-eval built different prompts for Mode A than {GOLD_PATH} holds")
    t0 = time.perf_counter()
    rows = mode_a_gold_rows(lm, pairs)
    log.info("Mode A gold NLL: %.1f s", time.perf_counter() - t0)
    return {"covered": True, **entry, "replay": replay, "note": mode_a_note(replay)}, {"mode_a": rows}


def main() -> None:
    run_stage(run, launcher=distributed.relaunch)


if __name__ == "__main__":
    main()
