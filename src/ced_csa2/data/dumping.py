"""Dumping hidden states and true K/V: the dump's fingerprint, one batch's forward with the hooks,
the record loop with resume, and merging data-parallel shards.

Stage ``dump``'s file grows under ``data/dump.partial.h5`` and is renamed when complete.  If the
process is killed, the next run resumes after the last complete batch of records
(when model, tokenizer, corpus and params are unchanged, and the partial file passes
its checksums) and ends with the same datasets as an uninterrupted run.  Non-finite
activations and file-system failures (full disk, file-size limit) end the stage with
one line naming the file (:class:`~ced_csa2.data.dump_file.DumpError`, exit 2).

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
from pathlib import Path

import numpy as np
import torch

from .. import kv_hooks
from ..config import Params, to_dict
from ..pipeline import distributed
from ..pipeline.paths import DUMP_PARTIAL, DUMP_PATH, dump_shard
from ..pipeline.progress import Progress
from ..plan import LayerPlan
from .dump_file import DumpError, DumpLayout, DumpReader, DumpWriter, copy_records
from .records import pad_batch

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


def dump_records(model, pad_id: int, plan: LayerPlan, ids: list[list[int]], cfg, writer: DumpWriter,
                  max_batches: int | None) -> int | None:
    """Append ``ids`` in batches of ``cfg.batch_size`` and finalise; tokens written, ``None`` if ``max_batches`` stopped it."""
    batches = [ids[i:i + cfg.batch_size] for i in range(0, len(ids), cfg.batch_size)]
    n_tokens, total = 0, writer.n_records + len(ids)
    try:
        for b, rows in enumerate(Progress(batches, desc="dump", unit="batch", disable=not distributed.is_main())):
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


def shard_done(path: Path, fp: str) -> bool:
    """Whether ``path`` is a complete shard of this very dump (fingerprint ``fp``)."""
    try:
        with DumpReader(path, verify=False) as shard:  # copy_records verifies what it copies
            return shard.attrs.get("fingerprint") == fp
    except DumpError:
        return False


def merge_shards(workdir: Path, layout: DumpLayout, chunk_kib: int, attrs: dict, world: int) -> None:
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
