"""``eval_ppl`` stage: perplexity of every runtime group, and Mode A's prefix perplexity.

    python -m ced_csa2.stages.eval_ppl          # what `dvc repro eval_ppl` runs

Protocol.  The records of ``data/corpus/eval.jsonl`` (held-out articles on the embedded
default, WikiText-2 test lines on the full profile), each truncated to
``data.max_tokens``, are scored teacher-forced.  Perplexity is corpus-level:
``exp(sum NLL / sum scored tokens)`` over all records, every token after the first
scored once.

* Mode B: one figure per group in ``eval_ppl.groups`` and its change against baseline.
* Mode B agreement: ``kl`` (mean per-token KL(baseline ‖ group)) and ``top1_pct`` (tokens
  whose argmax is the baseline's) on the same scored tokens, with paired CIs.
* Mode A: prompt = first ``prefix_fraction`` of each record, scored on the rest, for the
  plain model and for the prefill skip (non-attention layers above the cut start from
  a zero state; the first ``mode_a.sink`` and the last ``mode_a.replay`` prompt tokens through
  every layer) with the maps of
  ``mode_a.maps`` (``trained``: stage ``tune_mode_a``'s): prefix PPL, ΔPPL, KL and top-1
  against the plain prefill, and the prefill speed-up's bound (layer passes saved).  The speed-up itself is a timing of the
  machine (``eval_ppl.timing_records`` seeded prompts, each arm warmed up, arms alternated,
  median of 3): it goes to ``timings/eval_ppl.json``, never into the results, and a ratio
  above the bound is an error.  Needs a covering plan; otherwise an explicit "not
  covered" entry names the uncovered attention layers.

Other domains (``data.domains``: text the maps were not fitted on, prepared into
``data/corpus/domains/<name>.jsonl``): a seeded sample of ``eval_ppl.domain_records`` records
of each, scored the same way -- every group and Mode A (untimed) -- into ``domains.<name>``
with its own protocol; the paired intervals are over that domain's records.

Data-parallel (``distributed.nproc``): each rank scores a contiguous share of the batches
(and of Mode A's records); the per-record sums are added up on every rank, so every figure
and interval is the single-process one; rank 0 writes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..ced_runtime import CEDParts, load_mode_a_parts, load_parts
from ..config import Params
from ..data.records import check_prepared
from ..eval.perplexity import eval_ids, groups_ppl, mode_a_prefix, protocol
from ..model_utils import load_model_and_tokenizer, resolve_device
from ..pipeline import distributed
from ..pipeline.atomic_files import write_json
from ..pipeline.map_roles import MAIN
from ..pipeline.paths import EVAL_JSONL, MODELS, PPL_METRICS, domain_jsonl
from ..pipeline.stage_runner import record_timing, run_stage, stage_arguments
from ..plan import load_plan
from ..groups import LOW_RANK_GROUPS

log = logging.getLogger(__name__)




def run(params: Params, workdir: Path = Path("."), *, parts: CEDParts | None = None,
        model_and_tok=None) -> dict:
    """Score every group; ``parts``/``model_and_tok`` override loading (tests).

    Without ``parts`` the maps come from ``workdir/models`` via
    :func:`ced_csa2.ced_runtime.load_parts`, which refuses a file made for another model,
    layer, geometry or plan (:class:`~ced_csa2.pipeline.checkpoint.CheckpointError`) before scoring.
    """
    with distributed.session(params.distributed):
        return _run(params, Path(workdir), parts, model_and_tok)


def _run(params: Params, workdir: Path, parts: CEDParts | None, model_and_tok) -> dict:
    cfg = params.eval_ppl
    plan, geo = load_plan(params.plan, params.model)
    check_prepared(params, workdir, EVAL_JSONL, *(domain_jsonl(d.name) for d in params.data.domains))
    device = distributed.local_device(resolve_device(cfg.device))
    model, tok = model_and_tok or load_model_and_tokenizer(params.model, device=device)
    given = parts
    if parts is None:
        parts = load_parts(workdir / MODELS, params, plan, geo, role=MAIN, device=device,
                           low_rank=any(g in LOW_RANK_GROUPS for g in cfg.groups))  # models/xkv.pt
    # Every domain's records before any scoring: a missing or short domain file fails in seconds.
    ids = {None: eval_ids(params, tok, workdir), **{d.name: eval_ids(params, tok, workdir, d.name)
                                                   for d in params.data.domains}}
    mode_a_parts = parts
    if given is None and not plan.uncovered(geo):
        mode_a_parts = load_mode_a_parts(workdir, params, plan, geo, device=device)
    seconds, scored = {}, {}
    for domain, rows in ids.items():
        log.info("Scoring %s: %d records", domain or f"{params.data.name} (held out)", len(rows))
        t0 = time.perf_counter()
        # All groups at once: the layers below the first one a group changes run once per batch.
        groups = groups_ppl(model, plan, cfg.groups, parts, rows, params, tok.pad_token_id)
        t1 = time.perf_counter()
        mode_a = mode_a_prefix(model, plan, geo, mode_a_parts, rows, cfg.prefix_fraction, params.seed,
                               timing_records=cfg.timing_records if domain is None else None,
                               block_tokens=cfg.score_block_tokens, replay=params.mode_a.replay,
                               sink=params.mode_a.sink)
        if mode_a["covered"]:
            mode_a["maps"] = "given" if given is not None else params.mode_a.maps
        seconds[domain or "held_out"] = {"groups_s": round(t1 - t0, 1), "mode_a_s": round(time.perf_counter() - t1, 1)}
        scored[domain] = {"protocol": protocol(params, model, plan, rows, groups[cfg.groups[0]]["tokens"], domain),
                          "groups": groups, "mode_a": mode_a}
    in_domain = scored.pop(None)
    record_timing(**seconds, threads=torch.get_num_threads(), mode_a_prefill=in_domain["mode_a"].pop("timing", None))
    metrics = {**in_domain, "domains": scored}
    if distributed.is_main():
        write_json(workdir / PPL_METRICS, metrics)
    return metrics


def main(argv: Sequence[str] | None = None) -> None:
    run_stage(run, *stage_arguments(run, argv), launcher=distributed.relaunch)


if __name__ == "__main__":
    main()
