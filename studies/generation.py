"""Every group decoded through the cache that holds its bytes, judged by what it generates.

    dvc repro studies/dvc.yaml:generation       # runs: python studies/generation.py

Every figure of the main pipeline is teacher-forced under Mode B's substitution, with bytes by
formula.  Here each group the library supports (:func:`ced_csa2.eval.generation.supported_groups`:
``baseline``, ``share_plain``, ``ced``, ``csa2``, ``ced_csa2``, ``baseline_fp4``, ``csa2_fp4``,
``ced_csa2_fp4``; the rotated ``*_fp4_rot`` and ``xkv`` have no such cache yet) and Mode A
(the prefill skip, decoding on the ordinary cache it returns) greedily continue the same
prompts through that cache (:func:`~ced_csa2.eval.generation.group_cache`), and each is compared
with the baseline's own greedy continuation: tokens before the first divergence (mean, median),
agreement position by position, and the plain model's NLL per token of the continuation minus
that of the baseline's (paired bootstrap 95% CIs over prompts).  The cache's bytes after the
last step, used and allocated, are checked against the accounting to the byte.

Prompts: the first ``prompt_tokens`` tokens of ``prompts`` held-out eval records
(``data/corpus/eval.jsonl``, a seeded sample with ``eval_ppl``'s stream); a record shorter than
``prompt_tokens + 1`` tokens, or prompts and new tokens beyond the model's window, are refused
in one line before the model is loaded.  Maps: the main pipeline's (``models/``), Mode A's per
``mode_a.maps``.  Model dtype: the root params' (float32 on the embedded default).

Writes ``studies/generation/metrics.json``, ``generation.md`` and ``agreement.png``; wall times
to ``timings/study_generation.json`` (never into the metrics).
Params: ``studies/generation.yaml`` and the root ``params.yaml``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from ced_csa2.ced_runtime import load_mode_a_parts, load_parts
from ced_csa2.config import from_dict, load_params
from ced_csa2.data.records import read_records, seeded_subset
from ced_csa2.eval import generation as gen
from ced_csa2.eval.perplexity import EVAL_SAMPLE_STREAM
from ced_csa2.model_utils import load_config, load_model_and_tokenizer, load_tokenizer, resolve_device
from ced_csa2.pipeline.atomic_files import atomic_write_text, write_json
from ced_csa2.pipeline.figures import write_png
from ced_csa2.pipeline.paths import EVAL_JSONL, MODELS, TIMINGS
from ced_csa2.plan import load_plan
from ced_csa2.runtime.groups import GROUPS

STUDY_PARAMS = Path("studies/generation.yaml")
OUT = Path("studies/generation")
TIMINGS_FILE = TIMINGS / "study_generation.json"
log = logging.getLogger("generation")


@dataclass(frozen=True)
class Study:
    prompts: int
    prompt_tokens: int
    new_tokens: int
    batch_size: int


def load_study(path: Path = STUDY_PARAMS) -> Study:
    """The study's params, typed and checked (unknown or mistyped keys refused, naming them)."""
    study = from_dict(Study, yaml.safe_load(Path(path).read_text()))
    if study.prompts < 2 or study.prompt_tokens < 2 or study.new_tokens < 1 or study.batch_size < 1:
        raise ValueError(f"{path}: need prompts >= 2 (the intervals resample prompts), prompt_tokens >= 2 (Mode A "
                         f"prefills all but the last), new_tokens >= 1 and batch_size >= 1; got {study}")
    return study


def prompt_ids(params, study: Study, tok, workdir: Path) -> torch.Tensor:
    """The prompts ``(prompts, prompt_tokens)``: the first tokens of a seeded sample of the eval records.

    Raises
    ------
    ValueError
        One line: fewer records than prompts, or a record shorter than ``prompt_tokens + 1`` tokens.
    """
    path = workdir / EVAL_JSONL
    records = read_records(path)
    if len(records) < study.prompts:
        raise ValueError(f"{path}: {len(records)} eval records; the study takes {study.prompts} prompts")
    picked = [records[i] for i in seeded_subset(len(records), study.prompts, params.seed, EVAL_SAMPLE_STREAM)]
    need = study.prompt_tokens + 1
    ids = tok([r["text"] for r in picked], truncation=True, max_length=need)["input_ids"]
    for rec, row in zip(picked, ids):
        if len(row) < need:
            raise ValueError(f"{path}: record {rec['id']!r} is {len(row)} tokens long; a prompt of "
                             f"{study.prompt_tokens} tokens needs a record of at least {need}")
    return torch.tensor([row[:study.prompt_tokens] for row in ids])


def run(params, study: Study, workdir: Path = Path("."), *, model_and_tok=None, parts=None,
        mode_a_parts=None) -> tuple[dict, dict]:
    """``(metrics, seconds per label)``; ``model_and_tok``, ``parts`` and ``mode_a_parts`` override loading (tests)."""
    plan, geo = load_plan(params.plan, params.model)
    # Refused before the model loads: prompts beyond the window, short or missing records.
    gen.check_window(load_config(params.model), study.prompt_tokens, study.new_tokens)
    prompts = prompt_ids(params, study, model_and_tok[1] if model_and_tok else load_tokenizer(params.model), workdir)
    device = resolve_device(params.eval_ppl.device)
    model, _ = model_and_tok or load_model_and_tokenizer(params.model, device=device)
    device = next(model.parameters()).device
    prompts = prompts.to(device)
    parts = parts or load_parts(workdir / MODELS, params, plan, geo, device=device, extra_sources=False)
    covered = not plan.uncovered(geo)
    if covered and mode_a_parts is None:
        mode_a_parts = load_mode_a_parts(workdir, params, plan, geo, device=device)
    jobs = {g: dict(groups=[g]) for g in gen.supported_groups()}
    if covered:
        jobs[gen.MODE_A] = dict(groups=[], mode_a=mode_a_parts, replay=params.mode_a.replay, sink=params.mode_a.sink)
    runs, seconds = {}, {}
    for label, job in jobs.items():
        t0 = time.perf_counter()
        runs.update(gen.run_groups(model, plan, parts=parts, prompts=prompts, new_tokens=study.new_tokens,
                                   kv_format=params.kv_format, batch_size=study.batch_size, **job))
        seconds[label] = round(time.perf_counter() - t0, 2)
        log.info("%s: %.1f s", label, seconds[label])
    fid = gen.fidelity(model, prompts, {label: r.tokens for label, r in runs.items()}, seed=params.seed,
                       batch_size=study.batch_size)
    base = runs["baseline"]
    rows = {}
    for label, r in runs.items():
        f = fid[label]
        rows[label] = {
            "cache": r.kind,
            "first_divergence_mean": f["first_divergence"]["mean"]["value"],
            "first_divergence_mean_ci95": f["first_divergence"]["mean"]["ci95"],
            "first_divergence_median": f["first_divergence"]["median"]["value"],
            "first_divergence_median_ci95": f["first_divergence"]["median"]["ci95"],
            "agreement": f["agreement"]["mean"]["value"], "agreement_ci95": f["agreement"]["mean"]["ci95"],
            "agreement_by_position": f["agreement"]["by_position"],
            "agreement_by_position_ci95": f["agreement"]["by_position_ci95"],
            "delta_nll": f["delta_nll"]["value"], "delta_nll_ci95": f["delta_nll"]["ci95"],
            "used_bytes_per_token": r.used_per_token, "allocated_bytes_per_token": r.allocated_per_token,
            "used_ratio_to_baseline": r.used_per_token / base.used_per_token,
            "allocated_ratio_to_baseline": r.allocated_per_token / base.allocated_per_token,
            "per_prompt": {"first_divergence": f["first_divergence"]["per_prompt"],
                           "delta_nll": f["delta_nll"]["per_prompt"]},
        }
    protocol = {"model": params.model.hf_id or params.model.name, "dtype": str(model.dtype).removeprefix("torch."),
                "data": str(EVAL_JSONL), "prompts": study.prompts, "prompt_tokens": study.prompt_tokens,
                "new_tokens": study.new_tokens, "cached_positions": base.positions, "kv_format": params.kv_format,
                "plan": {"split": plan.split, "source": plan.source, "targets": list(plan.targets)},
                "mode_a": ({"replay": params.mode_a.replay, "sink": params.mode_a.sink, "maps": params.mode_a.maps}
                           if covered else "not run: the plan does not cover every attention layer above the cut"),
                "decoding": "greedy, each group through the cache that holds its bytes",
                "reference": "the baseline's own greedy continuation of the same prompts",
                "plausibility": ("the plain model's NLL per token of the continuation (teacher-forced) minus "
                                 "that of the baseline's"),
                "bytes": "K/V entries per cached position and prompt after the last step, used == accounted checked",
                "ci": "bootstrap over prompts, 95% (paired for the NLL difference)",
                "not_run": {g: gen.cache_refusal(g) for g in GROUPS if gen.cache_refusal(g)}}
    return {"protocol": protocol, "groups": rows}, seconds


def _ci(value: float, ci: list[float], fmt: str) -> str:
    return f"{value:{fmt}} [{ci[0]:{fmt}}, {ci[1]:{fmt}}]"


def markdown(m: dict) -> str:
    p = m["protocol"]
    lines = [f"Greedy generation through each group's own cache: {p['model']} ({p['dtype']}), n = {p['prompts']} "
             f"prompts of {p['prompt_tokens']} tokens from {p['data']}, N = {p['new_tokens']} new tokens each "
             f"({p['cached_positions']} cached positions after the last step), FP4 format {p['kv_format']}; "
             f"against {p['reference']}; CIs: {p['ci']}.",
             "",
             "| group | cache | first divergence, mean | median | agreement | Δ plausibility nats/token | "
             "used B/token | allocated B/token | used / baseline | allocated / baseline |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for g, r in m["groups"].items():
        lines.append(
            f"| {g} | {r['cache']} | {_ci(r['first_divergence_mean'], r['first_divergence_mean_ci95'], '.1f')} | "
            f"{_ci(r['first_divergence_median'], r['first_divergence_median_ci95'], '.1f')} | "
            f"{_ci(r['agreement'], r['agreement_ci95'], '.3f')} | {_ci(r['delta_nll'], r['delta_nll_ci95'], '+.4f')} | "
            f"{r['used_bytes_per_token']:,.0f} | {r['allocated_bytes_per_token']:,.0f} | "
            f"{r['used_ratio_to_baseline']:.3f} | {r['allocated_ratio_to_baseline']:.3f} |")
    lines += ["", "Not run (no cache holds their bytes yet): "
              + "; ".join(f"`{g}`: {why}" for g, why in p["not_run"].items()) + "."]
    return "\n".join(lines) + "\n"


def plot(m: dict, path: Path) -> None:
    """Agreement with the baseline against the position of the generated token, one line per group, CIs shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for g, r in m["groups"].items():
        if g == "baseline":
            continue
        x = range(1, len(r["agreement_by_position"]) + 1)
        line, = ax.plot(x, r["agreement_by_position"], label=g)
        lo, hi = zip(*r["agreement_by_position_ci95"])
        ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
    p = m["protocol"]
    ax.set_xlabel("position of the generated token")
    ax.set_ylabel("fraction of prompts agreeing with the baseline [95% CI]")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    ax.set_title(f"Greedy generation through each group's own cache\n{p['model']}, n = {p['prompts']}, "
                 f"{p['prompt_tokens']}-token prompts", fontsize=9)
    write_png(fig, path)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    metrics, seconds = run(load_params(Path("params.yaml")), load_study())
    write_json(OUT / "metrics.json", metrics)
    atomic_write_text(OUT / "generation.md", markdown(metrics))
    plot(metrics, OUT / "agreement.png")
    write_json(TIMINGS_FILE, {"seconds": seconds, "threads": torch.get_num_threads()})
    log.info("done:\n%s", markdown(metrics))


if __name__ == "__main__":
    main()
