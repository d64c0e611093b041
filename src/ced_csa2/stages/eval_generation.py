"""``eval_generation`` stage: every group greedy-decoded through the cache that holds its bytes.

    python -m ced_csa2.stages.eval_generation       # what `dvc repro eval_generation` runs

Every other figure of the pipeline is teacher-forced under Mode B's substitution, with bytes by
formula.  Here each group with such a cache (:func:`ced_csa2.eval.generation.supported_groups`:
``baseline``, ``share_plain``, ``ced``, ``csa2``, ``ced_csa2``, ``baseline_fp4``, ``csa2_fp4``,
``ced_csa2_fp4``, the rotated ``baseline_fp4_rot``, ``csa2_fp4_rot``, ``ced_csa2_fp4_rot``, whose
stores hold the rotated FP4 blocks, ``baseline_k6v4_rot`` and ``xkv``, whose
:class:`~ced_csa2.runtime.low_rank_kv.LowRankKVCache` holds its coefficients; every group has one) and Mode A (the prefill
skip, decoding on the ordinary cache it returns; covering plans) greedily continue the same
prompts through it (:func:`~ced_csa2.eval.generation.group_cache`), and each is compared with the
baseline's own greedy continuation: tokens before the first divergence (mean, median),
agreement position by position, and the plain model's NLL per token of the continuation minus
that of the baseline's (paired bootstrap 95% intervals over prompts).  The cache's bytes after
the last step, used and allocated, are checked against the accounting to the byte: a mismatch
fails the stage in one line naming the group.

Prompts: the first ``eval_generation.prompt_tokens`` tokens of ``eval_generation.prompts``
held-out eval records (``data/corpus/eval.jsonl``, a seeded sample with ``eval_ppl``'s stream; all
of them when there are fewer);
a record shorter than ``prompt_tokens + 1`` tokens, or prompts and new tokens beyond the
model's window, are refused in one line before the model is loaded.  Maps: the main
pipeline's (``models/``), Mode A's per ``mode_a.maps``.

Writes ``metrics/generation.json`` (``protocol``, ``groups``: one row per group and ``mode_a``);
the report turns it into a table, the headline's generation columns and
``reports/agreement.png``.  Wall seconds per phase (``phase_seconds``: ``generation``, every group's
prompts and their decode, and ``fidelity``, the figures), the torch thread count, and each group's
decode step time through its cache over the baseline's ``DynamicCache`` go to
``timings/eval_generation.json``, never into the metrics.  The step times are the generation's own
steps of the first batch (:func:`~ced_csa2.eval.generation.run_groups`: the groups alternated step by
step, the first step of each untimed, each group's median over the rest), so timing adds no step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..ced_runtime import load_mode_a_parts, load_parts
from ..config import Params
from ..data.records import check_prepared, read_records
from ..eval import generation as gen
from ..eval.perplexity import EVAL_SAMPLE_STREAM
from ..model_utils import load_config, load_model_and_tokenizer, load_tokenizer, resolve_device
from ..pipeline.atomic_files import write_json
from ..pipeline.map_roles import MAIN
from ..pipeline.paths import EVAL_JSONL, GENERATION_METRICS, MODELS
from ..pipeline.stage_runner import record_timing, run_stage, stage_arguments
from ..pipeline.timing import PROTOCOL as TIMING_PROTOCOL
from ..plan import load_plan

log = logging.getLogger(__name__)


def run(params: Params, workdir: Path = Path(".")) -> dict:
    """Decode every group and Mode A; returns the metrics written to ``metrics/generation.json``."""
    workdir, cfg = Path(workdir), params.eval_generation
    plan, geo = load_plan(params.plan, params.model)
    check_prepared(params, workdir, EVAL_JSONL)
    # Refused before the model loads: prompts beyond the window, short or missing records.
    gen.check_window(load_config(params.model), cfg.prompt_tokens, cfg.new_tokens)
    path = workdir / EVAL_JSONL
    prompts = gen.prompt_ids(read_records(path), path, load_tokenizer(params.model), cfg.prompts, cfg.prompt_tokens,
                             params.seed, EVAL_SAMPLE_STREAM)
    model, _ = load_model_and_tokenizer(params.model, device=resolve_device(cfg.device))
    device = next(model.parameters()).device
    prompts = prompts.to(device)
    parts = load_parts(workdir / MODELS, params, plan, geo, role=MAIN, device=device, extra_sources=False,
                       low_rank=True)  # xkv decodes too: models/xkv.pt
    covered = not plan.uncovered(geo)
    mode_a = dict(mode_a=load_mode_a_parts(workdir, params, plan, geo, device=device), replay=params.mode_a.replay,
                  sink=params.mode_a.sink) if covered else {}
    t_phase = time.perf_counter()
    decoded = gen.run_groups(model, plan, gen.supported_groups(), parts, prompts, cfg.new_tokens, params.kv_format,
                             batch_size=cfg.batch_size, **mode_a)
    runs = decoded.runs
    log.info("%d groups%s: %d prompts x %d tokens in %.1f s", len(gen.supported_groups()), " and Mode A" * covered,
             len(prompts), cfg.new_tokens, time.perf_counter() - t_phase)
    phases = {"generation": time.perf_counter() - t_phase}
    t_phase = time.perf_counter()
    rows = gen.generation_rows(model, prompts, runs, seed=params.seed, batch_size=cfg.batch_size)
    phases["fidelity"] = time.perf_counter() - t_phase
    # Decode step time through each group's cache against the ordinary one: a timing, never a metric.
    steps = decoded.step_seconds
    step_timing = {} if steps is None else dict(
        decode_step_ms={g: round(1e3 * t, 3) for g, t in steps.seconds.items()},
        decode_step_ratio={g: round(t / steps.seconds["baseline"], 3) for g, t in steps.seconds.items()},
        decode_step_protocol=(f"the generation's decode steps of its first batch ({len(prompts[:cfg.batch_size])} "
                              f"prompts of {cfg.prompt_tokens} tokens, prefilled per cache), the groups alternated: "
                              f"{TIMING_PROTOCOL.format(repeats=steps.repeats)}; "
                              "one greedy decode step per call; ratio: over the baseline's DynamicCache"))
    # the thread count beside the figures: the every-layer block caches' tokens depend on it (BLAS order), as on the batch
    record_timing(threads=torch.get_num_threads(), phase_seconds={phase: round(t, 2) for phase, t in phases.items()},
                  **step_timing)
    protocol = {"model": params.model.hf_id or params.model.name, "dtype": str(model.dtype).removeprefix("torch."),
                "data": str(EVAL_JSONL), "domain": params.data.name, "prompts": len(prompts),
                "prompt_tokens": cfg.prompt_tokens, "new_tokens": cfg.new_tokens, "batch_size": cfg.batch_size,
                "cached_positions": runs["baseline"].positions, "kv_format": params.kv_format,
                "decoding": "greedy, each group through the cache that holds its bytes",
                "reference": "the baseline's own greedy continuation of the same prompts",
                "plausibility": ("the plain model's NLL per token of the continuation (teacher-forced) minus "
                                 "that of the baseline's"),
                "bytes": "K/V entries per cached position and prompt after the last step, used == accounted checked",
                "ci": "bootstrap over prompts, 95% (paired for the NLL difference)",
                **gen.runs_protocol(plan, {"replay": params.mode_a.replay, "sink": params.mode_a.sink,
                                           "maps": params.mode_a.maps}, covered)}
    metrics = {"protocol": protocol, "groups": rows}
    write_json(workdir / GENERATION_METRICS, metrics)
    return metrics


def main(argv: Sequence[str] | None = None) -> None:
    run_stage(run, *stage_arguments(run, argv))


if __name__ == "__main__":
    main()
