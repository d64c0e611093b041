"""``dump`` stage: hidden states and true K/V of the training corpus, to chunked HDF5.

    python -m ced_csa2.stages.dump          # what `dvc repro dump` runs

Reads ``params.yaml`` and ``data/corpus/train.jsonl``; runs the base model over the
records in batches (right padding, ``model.dtype`` compute) with hooks that capture
``H_split`` and the ``k_proj``/``v_proj`` outputs (pre-k_norm, pre-RoPE) of every
layer the plan needs; stores only real tokens in ``data/dump/dump.h5`` (format in
:mod:`ced_csa2.h5store`) and writes ``metrics/dump.json``.

The file grows under ``data/dump.partial.h5`` and is renamed when complete.  If the
process is killed, the next run resumes after the last complete batch of records
(when model, tokenizer, corpus and params are unchanged, and the partial file passes
its checksums) and ends with the same datasets as an uninterrupted run.  Non-finite
activations and file-system failures (full disk, file-size limit) end the stage with
one line naming the file (:class:`~ced_csa2.h5store.DumpError`, exit 2).
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
from ..entry import run_stage
from ..h5store import DumpLayout, DumpWriter
from ..io_utils import write_json
from ..model_utils import load_model_and_tokenizer, resolve_device, tokenizer_hash
from ..paths import DUMP_METRICS, DUMP_PARTIAL, DUMP_PATH, TRAIN_JSONL
from ..plan import LayerPlan, load_plan
from ..records import pad_batch, read_records, seeded_subset, tokenize

log = logging.getLogger(__name__)

DUMP_SAMPLE_STREAM = 6  # numpy seed-sequence tag (loader.py uses 0-3, training.py 4, objectives.py 5)




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
    the process had been killed there (used by the resume tests).
    """
    workdir = Path(workdir)
    model_cfg, cfg = params.model, params.dump
    plan, geo = load_plan(params.plan, model_cfg)
    records = read_records(workdir / TRAIN_JSONL)
    records = [records[i] for i in seeded_subset(len(records), cfg.records, params.seed, DUMP_SAMPLE_STREAM)]
    model, tok = load_model_and_tokenizer(model_cfg, device=resolve_device(cfg.device))
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
    writer = DumpWriter(workdir / DUMP_PATH, workdir / DUMP_PARTIAL, layout, cfg.chunk_kib, attrs)
    start = writer.n_records
    batches = [list(range(i, min(i + cfg.batch_size, len(ids)))) for i in range(start, len(ids), cfg.batch_size)]
    log.info("dumping %d records (%d already done) of %s: layers %s + H_%d, %s compute, %s storage",
             len(ids) - start, start, model_cfg.name, list(plan.kv_layers), plan.split, attrs["compute_dtype"],
             cfg.storage_dtype)
    n_tokens, t0 = 0, time.perf_counter()
    try:
        for b, batch in enumerate(tqdm(batches, desc="dump", unit="batch")):
            if max_batches is not None and b >= max_batches:
                writer.close()
                return None
            rows = [ids[i] for i in batch]
            x, mask = pad_batch(rows, tok.pad_token_id)
            arrays = forward_batch(model, plan, x, mask, cfg.storage_dtype)
            flat = np.fromiter((t for r in rows for t in r), dtype=np.int32)
            writer.append(arrays, flat, [len(r) for r in rows])
            n_tokens += len(flat)
        seconds = time.perf_counter() - t0
        path = writer.finalize()
    except BaseException:
        # Interrupted or failed: close the partial file cleanly (it stays resumable; the writer has
        # already removed it when it cannot be resumed) instead of leaving HDF5 to close it at exit.
        writer.abort()
        raise
    metrics = {
        "records": len(ids), "tokens": int(sum(len(r) for r in ids)), "bytes": path.stat().st_size,
        "tokens_this_run": n_tokens, "seconds_this_run": round(seconds, 3),
        "tokens_per_s": round(n_tokens / seconds, 1) if seconds > 0 else None,
        "resumed_from_record": start, "device": str(next(model.parameters()).device),
        "threads": torch.get_num_threads(), "model": model_cfg.name, "compute_dtype": attrs["compute_dtype"],
        "storage_dtype": cfg.storage_dtype, "kv_layers": list(plan.kv_layers), "split": plan.split,
    }
    write_json(workdir / DUMP_METRICS, metrics)
    log.info("wrote %s: %d records, %d tokens, %.1f MB", path, metrics["records"], metrics["tokens"],
             metrics["bytes"] / 1e6)
    return metrics


def main() -> None:
    run_stage(run)


if __name__ == "__main__":
    main()
