"""``dump`` stage: hidden states and true K/V of the training corpus, to chunked HDF5.

    python -m ced_csa2.stages.dump          # what `dvc repro dump` runs

Reads ``params.yaml`` and ``data/corpus/train.jsonl``; runs the base model over the
records in batches (right padding, ``model.dtype`` compute) with hooks that capture
``H_split`` and the ``k_proj``/``v_proj`` outputs (pre-k_norm, pre-RoPE) of every
layer the plan needs; stores only real tokens in ``data/dump/dump.h5`` (format in
:mod:`ced_csa2.data.h5store`) and writes ``metrics/dump.json``.

The file grows under ``data/dump.partial.h5`` and is renamed when complete.  If the
process is killed, the next run resumes after the last complete batch of records
(when model, tokenizer, corpus and params are unchanged, and the partial file passes
its checksums) and ends with the same datasets as an uninterrupted run.  Non-finite
activations and file-system failures (full disk, file-size limit) end the stage with
one line naming the file (:class:`~ced_csa2.data.h5store.DumpError`, exit 2).

Data-parallel (``distributed.nproc: N``): the single-process batches are dealt out to
the ranks in contiguous runs (:func:`ced_csa2.pipeline.distributed.batch_bounds`), so each batch
is computed exactly as one process computes it.  Rank ``r`` grows its own shard
(:func:`ced_csa2.pipeline.paths.dump_shard`, resumable like the single-process file); rank 0 then
copies the shards, in rank order, into ``data/dump/dump.h5`` (checksums recomputed on the
file's own row grid) and removes them.  The result holds the single-process dump's rows
in its order, so every reader is unchanged.  The copy costs a read and a write of the
dump -- seconds per GB against minutes of forward passes per GB; an HDF5 virtual dataset
would avoid it but has no chunks to align reads with, and its checksum blocks would
straddle shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .. import kv_hooks
from ..config import Params, params_hash, to_dict
from ..data.h5store import DumpError, DumpLayout, DumpReader, DumpWriter, copy_records
from ..data.records import DUMP_SAMPLE_STREAM, pad_batch, read_records, seeded_subset, tokenize
from ..model_utils import load_model_and_tokenizer, resolve_device, tokenizer_hash
from ..pipeline import distributed
from ..pipeline.entry import record_timing, run_stage
from ..pipeline.io_utils import write_json
from ..pipeline.paths import DUMP_METRICS, DUMP_PARTIAL, DUMP_PATH, TRAIN_JSONL, dump_shard
from ..plan import LayerPlan, load_plan

log = logging.getLogger(__name__)




def fingerprint(params: Params, corpus: Path, tok_hash: str) -> str:
    """What must match for a partial dump to be resumed."""
    h = hashlib.sha256(corpus.read_bytes())
    h.update(json.dumps([to_dict(params.model), to_dict(params.plan), to_dict(params.dump),
                         params.data.max_tokens, params.seed, tok_hash], sort_keys=True).encode())
    return h.hexdigest()



def to_storage(t: torch.Tensor, storage_dtype: str) -> np.ndarray:
    """A captured activation as the on-disk numpy array (bf16 kept as its uint16 bits)."""
    if storage_dtype == "bfloat16":
        return t.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
    return t.to(getattr(torch, storage_dtype)).cpu().numpy()


@torch.inference_mode()
def forward_batch(model, plan: LayerPlan, ids: torch.Tensor, mask: torch.Tensor, storage_dtype: str) -> dict:
    """Captured arrays of the real (non-pad) tokens of one batch, records concatenated.

    Returns ``{"h_split": (n, hidden), "k_{l}": (n, kv_dim), "v_{l}": ...}`` with
    ``n = mask.sum()``; rows in (record, position) order.
    """
    device = next(model.parameters()).device
    with kv_hooks.capture(model, plan.kv_layers, [plan.split]) as store:
        # The base model without the LM head: logits are not needed for the dump.
        model.model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
    keep = mask.to(device).bool()
    out = {"h_split": to_storage(store["h"][plan.split][keep], storage_dtype)}
    for layer in plan.kv_layers:
        out[f"k_{layer}"] = to_storage(store["k"][layer][keep], storage_dtype)
        out[f"v_{layer}"] = to_storage(store["v"][layer][keep], storage_dtype)
    return out


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
    }
    world, t0 = distributed.world_size(), time.perf_counter()
    lo, hi = distributed.batch_bounds(len(ids), cfg.batch_size)
    if world == 1:
        final, partial, fp = workdir / DUMP_PATH, workdir / DUMP_PARTIAL, attrs["fingerprint"]
    else:
        (final, partial), fp = dump_shard(distributed.rank(), world), f"{attrs['fingerprint']} records [{lo}, {hi})"
        final, partial = workdir / final, workdir / partial
    start, n_tokens = hi, 0
    if not (world > 1 and _shard_done(final, fp)):  # a shard done by a run killed while merging is kept
        writer = DumpWriter(final, partial, layout, cfg.chunk_kib, attrs | {"fingerprint": fp})
        start = lo + writer.n_records
        log.info("dumping %d records (%d already done) of %s: layers %s + H_%d, %s compute, %s storage",
                 hi - start, start - lo, model_cfg.name, list(plan.kv_layers), plan.split, attrs["compute_dtype"],
                 cfg.storage_dtype)
        n_tokens = _dump_records(model, tok.pad_token_id, plan, ids[start:hi], cfg, writer, max_batches)
    # Every rank stops, or none does (the merge needs every shard); tokens summed over the ranks.
    stopped_and_tokens = torch.tensor([float(n_tokens is None), float(n_tokens or 0)], dtype=torch.float64)
    distributed.all_reduce_sum(stopped_and_tokens)
    if stopped_and_tokens[0] > 0:
        return None
    n_tokens, seconds = int(stopped_and_tokens[1]), time.perf_counter() - t0
    if world > 1:
        if distributed.is_main():
            _merge(workdir, layout, cfg.chunk_kib, attrs, world)
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


def _dump_records(model, pad_id: int, plan: LayerPlan, ids: list[list[int]], cfg, writer: DumpWriter,
                  max_batches: int | None) -> int | None:
    """Append ``ids`` in batches of ``cfg.batch_size`` and finalise; tokens written, ``None`` if ``max_batches`` stopped it."""
    batches = [ids[i:i + cfg.batch_size] for i in range(0, len(ids), cfg.batch_size)]
    n_tokens, total = 0, writer.n_records + len(ids)
    try:
        for b, rows in enumerate(tqdm(batches, desc="dump", unit="batch", disable=not distributed.is_main())):
            if max_batches is not None and b >= max_batches:
                writer.close()
                return None
            x, mask = pad_batch(rows, pad_id)
            arrays = forward_batch(model, plan, x, mask, cfg.storage_dtype)
            flat = np.fromiter((t for r in rows for t in r), dtype=np.int32)
            writer.append(arrays, flat, [len(r) for r in rows])
            n_tokens += len(flat)
            # Per rank (each names its own file): how far a resume would start, as the batch is committed.
            log.info("%s: %d of %d records committed", writer.partial_path, writer.n_records, total)
        writer.finalize()
    except BaseException:
        # Interrupted or failed: close the partial file cleanly (it stays resumable; the writer has
        # already removed it when it cannot be resumed) instead of leaving HDF5 to close it at exit.
        writer.abort()
        raise
    return n_tokens


def _shard_done(path: Path, fp: str) -> bool:
    """Whether ``path`` is a complete shard of this very dump (fingerprint ``fp``)."""
    try:
        with DumpReader(path, verify=False) as shard:  # copy_records verifies what it copies
            return shard.attrs.get("fingerprint") == fp
    except DumpError:
        return False


def _merge(workdir: Path, layout: DumpLayout, chunk_kib: int, attrs: dict, world: int) -> None:
    """Rank 0: the complete shards, in rank order, as ``data/dump/dump.h5`` (resumable, like any dump); then remove them."""
    writer = DumpWriter(workdir / DUMP_PATH, workdir / DUMP_PARTIAL, layout, chunk_kib, attrs)
    shards = [workdir / dump_shard(r, world)[0] for r in range(world)]
    seen = 0
    try:
        for path in shards:
            with DumpReader(path) as shard:
                copy_records(shard, writer, max(0, writer.n_records - seen))
                seen += shard.n_records
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    for path in shards:
        path.unlink()


def main() -> None:
    run_stage(run, launcher=distributed.relaunch)


if __name__ == "__main__":
    main()
