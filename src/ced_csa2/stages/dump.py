"""``dump`` stage: hidden states and true K/V of the training corpus, to chunked HDF5.

    python -m ced_csa2.stages.dump          # what `dvc repro dump` runs

Reads ``params.yaml`` and ``data/corpus/train.jsonl`` (refused when made for other params:
:func:`~ced_csa2.data.records.check_prepared`); runs the base model over the
records in batches (right padding, ``model.dtype`` compute) with hooks that capture
``H_split`` and the ``k_proj``/``v_proj`` outputs (pre-k_norm, pre-RoPE) of every
layer the plan needs; stores only real tokens in ``data/dump/dump.h5`` (format in
:mod:`ced_csa2.data.dump_file`) and writes ``metrics/dump.json``.

Resumes after a kill and runs data-parallel as :mod:`ced_csa2.data.dumping` describes.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..config import Params, params_hash, provenance, to_dict
from ..data.dump_file import DumpLayout, DumpWriter
from ..data.dumping import dump_records, fingerprint, merge_shards, shard_done
from ..data.records import DUMP_SAMPLE_STREAM, check_prepared, read_records, seeded_subset, tokenize
from ..model_utils import load_model_and_tokenizer, resolve_device, tokenizer_hash
from ..pipeline import distributed
from ..pipeline.atomic_files import write_json
from ..pipeline.paths import DUMP_METRICS, DUMP_PARTIAL, DUMP_PATH, TRAIN_JSONL, dump_shard
from ..pipeline.stage_runner import record_timing, run_stage, stage_arguments
from ..plan import load_plan

log = logging.getLogger(__name__)

PROVENANCE = ("seed", "model", "plan", "dump", "data.max_tokens")  # of dvc.yaml's params for dump


def run(params: Params, workdir: Path = Path("."), *, max_batches: int | None = None) -> dict | None:
    """Dump the training corpus; returns the metrics, or ``None`` when stopped by ``max_batches``.

    ``max_batches`` stops after that many batches *without* finalising, exactly as if
    the process had been killed there (used by the resume tests; each rank stops after that
    many of its batches).
    """
    with distributed.session(params.distributed):
        return _run(params, Path(workdir), max_batches)


def _run(params: Params, workdir: Path, max_batches: int | None) -> dict | None:
    model_cfg, cfg = params.model, params.dump
    plan, geo = load_plan(params.plan, model_cfg)
    check_prepared(params, workdir, TRAIN_JSONL)
    records = read_records(workdir / TRAIN_JSONL)
    records = [records[i] for i in seeded_subset(len(records), cfg.records, params.seed, DUMP_SAMPLE_STREAM)]
    model, tok = load_model_and_tokenizer(model_cfg, device=distributed.local_device(resolve_device(cfg.device)))
    ids = tokenize(tok, records, params.data.max_tokens)
    tok_hash = tokenizer_hash(tok)
    layout = DumpLayout(geo.hidden_size, geo.kv_dim, plan.kv_layers, cfg.storage_dtype)
    attrs = {
        "fingerprint": fingerprint(params, workdir / TRAIN_JSONL, tok_hash),
        "model": model_cfg.name, "model_id": model_cfg.hf_id or model_cfg.name,
        "plan": json.dumps(to_dict(params.plan)), "split": plan.split,
        "compute_dtype": str(model.dtype).removeprefix("torch."), "storage_dtype": cfg.storage_dtype,
        "pre_norm": True, "pre_rope": True, "tokenizer_sha256": tok_hash,
        "params_hash": params_hash(params.model, params.plan, params.dump),
        "provenance": json.dumps(provenance(params, *PROVENANCE)),
    }
    world, t0 = distributed.world_size(), time.perf_counter()
    lo, hi = distributed.batch_bounds(len(ids), cfg.batch_size)
    if world == 1:
        final, partial, fp = workdir / DUMP_PATH, workdir / DUMP_PARTIAL, attrs["fingerprint"]
    else:
        (final, partial), fp = dump_shard(distributed.rank(), world), f"{attrs['fingerprint']} records [{lo}, {hi})"
        final, partial = workdir / final, workdir / partial
    start, n_tokens = hi, 0
    if not (world > 1 and shard_done(final, fp)):  # a shard done by a run killed while merging is kept
        writer = DumpWriter(final, partial, layout, cfg.chunk_kib, attrs | {"fingerprint": fp})
        start = lo + writer.n_records
        log.info("dumping %d records (%d already done) of %s: layers %s + H_%d, %s compute, %s storage",
                 hi - start, start - lo, model_cfg.name, list(plan.kv_layers), plan.split, attrs["compute_dtype"],
                 cfg.storage_dtype)
        n_tokens = dump_records(model, tok.pad_token_id, plan, ids[start:hi], cfg, writer, max_batches)
    # Every rank stops, or none does (the merge needs every shard); tokens summed over the ranks.
    stopped_and_tokens = torch.tensor([float(n_tokens is None), float(n_tokens or 0)], dtype=torch.float64)
    distributed.all_reduce_sum(stopped_and_tokens)
    if stopped_and_tokens[0] > 0:
        return None
    n_tokens, seconds = int(stopped_and_tokens[1]), time.perf_counter() - t0
    if world > 1:
        if distributed.is_main():
            merge_shards(workdir, layout, cfg.chunk_kib, attrs, world)
        distributed.barrier()
    path = workdir / DUMP_PATH
    record_timing(tokens_this_run=n_tokens, seconds_this_run=round(seconds, 3), threads=torch.get_num_threads(),
                  tokens_per_s=round(n_tokens / seconds, 1) if seconds > 0 else None)
    metrics = {
        "records": len(ids), "tokens": int(sum(len(r) for r in ids)), "bytes": path.stat().st_size,
        "resumed_from_record": start, "nproc": world, "device": str(next(model.parameters()).device),
        "model": model_cfg.name, "compute_dtype": attrs["compute_dtype"],
        "storage_dtype": cfg.storage_dtype, "kv_layers": list(plan.kv_layers), "split": plan.split,
    }
    if distributed.is_main():
        write_json(workdir / DUMP_METRICS, metrics)
        log.info("wrote %s: %d records, %d tokens, %.1f MB", path, metrics["records"], metrics["tokens"],
                 metrics["bytes"] / 1e6)
    return metrics


def main(argv: Sequence[str] | None = None) -> None:
    run_stage(run, *stage_arguments(run, argv), launcher=distributed.relaunch)


if __name__ == "__main__":
    main()
