"""``eval_retrieval`` stage: the passkey task through every group's own cache, against the baseline on the same needles.

    python -m ced_csa2.stages.eval_retrieval       # what `dvc repro eval_retrieval` runs

Every other quality figure of the pipeline is next-token PPL/KL or greedy agreement on short
records; sharing K/V across layers is what a retrieval test at length would break.  Here the
passkey task of :mod:`ced_csa2.eval.retrieval` (a 5-digit key hidden in held-out filler at a
stratified depth, asked for at the end; retrieved when greedy decoding returns every token of
it) runs for each group with a cache that holds its bytes
(:func:`ced_csa2.eval.generation.supported_groups`, each through
:func:`~ced_csa2.eval.generation.group_cache`; :func:`~ced_csa2.eval.retrieval.groups_hits`
prefills the layers below the first one a group's cache changes once per batch for every group,
the same logits to the bit) and for Mode A (the prefill skip, decoding on the
ordinary cache it returns; covering plans), as ``eval_generation`` decodes them.  Per label:
accuracy with its Wilson 95% interval and its change against the baseline in points over the
same records (paired bootstrap 95%); the report's headline shows the accuracy
(``passkey_pct``), so a compression that breaks retrieval shows in ``dvc metrics diff``.

Why the defaults (``eval_retrieval`` in ``conf/config.yaml``): ``length`` 1,024 is the longest
length where the embedded default's baseline still retrieves >= 80% (``studies/retrieval``:
``docs/results.md``, "Long-context retrieval"), so a group's loss is not hidden by a baseline that
fails anyway; ``records`` 8 is what the pipeline's time budget buys (the generation work adds
a bounded share to ``make repro``'s time, most of it ``eval_generation``'s: what is left for this
stage, at its cost per record and label on 2 CPU cores, gives 8 records over 9 labels; the
figures: ``docs/costs.md``, "Budget").  Eight records
catch a broken cache (the baseline retrieves most of 8, a cache that loses the needle none), not a
5-point loss: that takes the paired test of ``studies/retrieval.yaml``'s n.

Records: ``eval_retrieval.records`` passkey prompts of exactly ``eval_retrieval.length`` tokens
from the root ``seed``, the filler the held-out records joined (``data/corpus/eval.jsonl``).
A length beyond the model's window, or a filler shorter than one record's share, is refused
in one line before the model is loaded.  Maps: the main pipeline's (``models/``), Mode A's per
``mode_a.maps``.

Writes ``metrics/retrieval.json`` (``protocol``, ``groups``: one row per label, with each
record's hit); wall seconds of the groups and of Mode A go to ``timings/eval_retrieval.json``, never into
the metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

from ..ced_runtime import CEDParts, load_mode_a_parts, load_parts
from ..config import Params
from ..data.records import check_prepared, read_records
from ..eval import generation as gen
from ..eval import retrieval
from ..model_utils import load_config, load_model_and_tokenizer, load_tokenizer, resolve_device
from ..pipeline.atomic_files import write_json
from ..pipeline.map_roles import MAIN
from ..pipeline.paths import EVAL_JSONL, MODELS, RETRIEVAL_METRICS
from ..pipeline.stage_runner import record_timing, run_stage, stage_arguments
from ..plan import load_plan

log = logging.getLogger(__name__)


def passkey_records(params: Params, workdir: Path, tok) -> list[retrieval.Passkey]:
    """The stage's records (from the tokenizer alone); refused in one line naming the key or file at fault.

    Raises
    ------
    ValueError
        ``eval_retrieval.length`` beyond the model's window, or ``data/corpus/eval.jsonl`` too short
        to fill one record.
    """
    cfg, path = params.eval_retrieval, workdir / EVAL_JSONL
    window = getattr(load_config(params.model).get_text_config(), "max_position_embeddings", None)
    if window is not None and cfg.length > window:
        raise ValueError(f"eval_retrieval.length {cfg.length} is beyond the model's window ({window} positions)")
    filler = tok("\n\n".join(r["text"] for r in read_records(path)), add_special_tokens=False)["input_ids"]
    try:
        return retrieval.passkey_prompts(tok, filler, cfg.length, cfg.records, params.seed, cfg.digits)
    except ValueError as e:
        raise ValueError(f"{path}: {e} (eval_retrieval.length {cfg.length})") from None


def run(params: Params, workdir: Path = Path("."), *, parts: CEDParts | None = None, model_and_tok=None) -> dict:
    """Score every group and Mode A; returns the metrics written to ``metrics/retrieval.json``.

    ``parts`` / ``model_and_tok`` override loading (tests): given ``parts`` serve Mode A too.
    """
    workdir, cfg = Path(workdir), params.eval_retrieval
    plan, geo = load_plan(params.plan, params.model)
    check_prepared(params, workdir, EVAL_JSONL)
    tok = model_and_tok[1] if model_and_tok else load_tokenizer(params.model)
    records = passkey_records(params, workdir, tok)  # refusals before the model loads
    model, _ = model_and_tok or load_model_and_tokenizer(params.model, device=resolve_device(cfg.device))
    device = next(model.parameters()).device
    given = parts is not None
    if not given:
        parts = load_parts(workdir / MODELS, params, plan, geo, role=MAIN, device=device, extra_sources=False,
                           low_rank=True)  # xkv decodes too: models/xkv.pt
    covered = not plan.uncovered(geo)
    jobs = {"groups": lambda: retrieval.groups_hits(model, plan, gen.supported_groups(), parts, records,
                                                    params.kv_format, cfg.batch_size)}
    if covered:
        mode_a = parts if given else load_mode_a_parts(workdir, params, plan, geo, device=device)
        jobs[gen.MODE_A] = lambda: {gen.MODE_A: retrieval.mode_a_hits(model, plan, mode_a, records, cfg.batch_size,
                                                                      replay=params.mode_a.replay,
                                                                      sink=params.mode_a.sink)}
    hits, seconds = {}, {}
    for job_name, job in jobs.items():
        t0 = time.perf_counter()
        hits.update(job())
        seconds[job_name] = round(time.perf_counter() - t0, 2)
        log.info("%s: done in %.1f s", job_name, seconds[job_name])
    for label, h in hits.items():
        log.info("%s: %d/%d retrieved", label, sum(h), len(records))
    record_timing(seconds=seconds)
    base = hits["baseline"]
    rows = {label: {**retrieval.accuracy_row(h, None if label == "baseline" else base, params.seed),
                    "hits": [int(x) for x in h]} for label, h in hits.items()}
    protocol = {"model": params.model.hf_id or params.model.name, "dtype": str(model.dtype).removeprefix("torch."),
                "data": str(EVAL_JSONL), "domain": params.data.name, "records": len(records), "length": cfg.length,
                "digits": cfg.digits, "seed": params.seed, "kv_format": params.kv_format,
                "task": ("passkey retrieval (Mohtashami & Jaggi 2023): instruction, filler with one needle sentence, "
                         "question; retrieved = greedy decoding returns every answer token"),
                "filler": f"{EVAL_JSONL} records joined with blank lines, a seeded offset per record",
                "depth": "stratified: record i's needle inside the i-th of n equal slices of the filler",
                "decoding": "each group through the cache that holds its bytes: the prompt prefilled, the answer "
                            "decoded one step per token",
                "ci": "accuracy: Wilson 95%; change vs baseline: paired bootstrap over the same records, 95%",
                **gen.runs_protocol(plan, {"replay": params.mode_a.replay, "sink": params.mode_a.sink,
                                           "maps": "given" if given else params.mode_a.maps}, covered)}
    metrics = {"protocol": protocol, "groups": rows}
    write_json(workdir / RETRIEVAL_METRICS, metrics)
    return metrics


def main(argv: Sequence[str] | None = None) -> None:
    run_stage(run, *stage_arguments(run, argv))


if __name__ == "__main__":
    main()
