"""Dump throughput against a plain forward over the same batches and dtype, in one run.

    python benchmarks/dump_throughput.py                  # params.yaml model, first 64 train records
    python benchmarks/dump_throughput.py --records 128 --repeats 3

Both paths see identical padded batches.  "plain" is ``model.model(...)`` (the base
model without LM head, as the dump runs it) with no hooks; "dump" is the stage's own
per-batch work: capture hooks, gathering real tokens, conversion to the storage dtype
and the HDF5 append.  Each batch (a shape) goes through :func:`ced_csa2.pipeline.timing.paired_seconds`:
one untimed call of each path, the two alternated over ``--repeats`` (>= 3) rounds, per-path
median, every reading synchronised with the device; a path's figure is the sum of its
per-batch medians.  Goal: ratio >= 0.85; no bound above 1 is claimed (the dump path
does the plain path's forward plus its own work, so above 1 would be noise).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from ced_csa2.config import load_params
from ced_csa2.data import dumping
from ced_csa2.data.dump_file import DumpLayout, DumpWriter
from ced_csa2.data.records import pad_batch, read_records, tokenize
from ced_csa2.model_utils import load_model_and_tokenizer, resolve_device
from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.paths import TRAIN_JSONL
from ced_csa2.pipeline.study_runner import run_main
from ced_csa2.pipeline.timing import PROTOCOL, paired_seconds
from ced_csa2.plan import load_plan


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--records", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    params = load_params(args.params)
    plan, geo = load_plan(params.plan, params.model)
    records = read_records(TRAIN_JSONL)[: args.records]
    model, tok = load_model_and_tokenizer(params.model, device=resolve_device(params.dump.device))
    ids = tokenize(tok, records, params.data.max_tokens)
    bs = params.dump.batch_size
    batches = [pad_batch(ids[i:i + bs], tok.pad_token_id) for i in range(0, len(ids), bs)]
    n_tokens = sum(len(r) for r in ids)
    layout = DumpLayout(geo.hidden_size, geo.kv_dim, plan.kv_layers, params.dump.storage_dtype)
    device = next(model.parameters()).device

    def plain(x, mask):
        with torch.inference_mode():
            model.model(input_ids=x.to(device), attention_mask=mask.to(device), use_cache=False)

    best = {"plain": 0.0, "dump": 0.0}  # sums of per-batch medians
    with tempfile.TemporaryDirectory() as tmp:
        # one file takes every call's rows (warm-up and rounds alike): appends cost the same either way
        writer = DumpWriter(Path(tmp) / "d.h5", Path(tmp) / "p.h5", layout, params.dump.chunk_kib,
                            {"fingerprint": "bench"})

        def dumped(x, mask, rows):
            arrays = dumping.forward_batch(model, plan, x, mask, params.dump.storage_dtype)
            writer.append(arrays, np.fromiter((i for r in rows for i in r), np.int32), [len(r) for r in rows])

        for (x, mask), start in zip(batches, range(0, len(ids), bs)):
            rows = ids[start:start + bs]
            t = paired_seconds({"plain": lambda: plain(x, mask), "dump": lambda: dumped(x, mask, rows)},
                               args.repeats, device=device)
            best = {k: best[k] + t.seconds[k] for k in best}
        writer.close()
    result = {
        "model": params.model.name, "dtype": str(model.dtype), "device": str(device),
        "threads": torch.get_num_threads(), "records": len(ids), "tokens": n_tokens, "batch_size": bs,
        "timing": PROTOCOL.format(repeats=args.repeats) + "; per batch, summed",
        "plain_tokens_per_s": round(n_tokens / best["plain"], 1),
        "dump_tokens_per_s": round(n_tokens / best["dump"], 1),
        "ratio_dump_over_plain": round(best["plain"] / best["dump"], 3),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    run_main(main)
