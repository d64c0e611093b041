"""Projector training throughput: the HDF5 block loader vs the same rows preloaded in memory.

    python benchmarks/train_throughput.py                      # data/dump/dump.h5, params.yaml
    python benchmarks/train_throughput.py --records 64 --epochs 16

Three runs train the stage's own projector (same heads, optimizer, schedule, autocast
and batch size, via :func:`ced_csa2.training.train_epoch`) on the train rows of the
first ``--records`` records: from tensors loaded up front (``TensorBatches``, the
baseline), and with ``BlockLoader`` streaming every epoch from the dump
(``preload_bytes=0``) and with its default (rows read once on the first epoch, then
gathered from memory).  Reported: total seconds including loading, the median epoch after
the first, and each loader's overhead over the baseline on both.  Goal: overhead <= 20%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from _timing import Clock

from ced_csa2.config import load_params
from ced_csa2.h5store import DumpReader
from ced_csa2.loader import BlockLoader, load_rows, record_split
from ced_csa2.model_utils import resolve_device
from ced_csa2.plan import LayerPlan
from ced_csa2.projector_training import build_projectors, heads_for
from ced_csa2.training import TensorBatches, train_epoch

DUMP = "data/dump/dump.h5"


def epoch_seconds(params, plan, geo_dims, batches, epochs, device) -> list[float]:
    """Train fresh projectors for ``epochs`` over ``batches``; wall seconds of each epoch."""
    projectors = build_projectors(params, (plan.source,), *geo_dims)
    heads = heads_for(projectors, geo_dims[1])
    opt = torch.optim.AdamW([p for pr in projectors.values() for p in pr.parameters()],
                            lr=params.train_projector.lr, weight_decay=params.train_projector.weight_decay)
    seconds, clock = [], Clock(device)
    for epoch in range(epochs):
        t = clock()
        batches.set_epoch(epoch)
        train_epoch(heads, opt, batches, device, params.train_projector.amp_dtype)
        seconds.append(clock() - t)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=8)
    args = ap.parse_args()

    params = load_params()
    plan = LayerPlan.from_config(params.plan)
    device = resolve_device("auto")
    with DumpReader(DUMP) as reader:
        n = min(args.records, reader.n_records)
        train, _ = record_split(reader.n_records, params.split.val_fraction, params.seed)
        train = train[train < n]
        offs = reader.record_offsets
        mask = np.zeros(reader.n_tokens, bool)
        for r in train:
            mask[offs[r]:offs[r + 1]] = True
        dims = (reader.layout.hidden_size, reader.layout.kv_dim)
    y = [f"{kind}_{plan.source}" for kind in "kv"]
    bs = params.train_projector.batch_size

    t = time.perf_counter()
    X, Y = load_rows(DUMP, ["h_split"], mask), load_rows(DUMP, y, mask)
    runs = {"in_memory": (time.perf_counter() - t,
                          epoch_seconds(params, plan, dims, TensorBatches(X, Y, bs, shuffle=True, seed=params.seed),
                                        args.epochs, device))}
    for name, preload in (("loader_streamed", 0), ("loader_preloaded", None)):
        loader = BlockLoader(DUMP, ["h_split"], y, mask, bs, shuffle=True, seed=params.seed, preload_bytes=preload)
        runs[name] = (0.0, epoch_seconds(params, plan, dims, loader, args.epochs, device))
        loader.close()
    total = {name: load + sum(sec) for name, (load, sec) in runs.items()}
    steady = {name: statistics.median(sec[1:]) for name, (_, sec) in runs.items()}
    print(json.dumps({
        "rows": int(mask.sum()), "epochs": args.epochs, "batch_size": bs, "device": str(device),
        "threads": torch.get_num_threads(), "amp_dtype": params.train_projector.amp_dtype,
        "in_memory_load_seconds": round(runs["in_memory"][0], 2),
        "total_seconds_incl_loading": {k: round(v, 2) for k, v in total.items()},
        "steady_epoch_seconds": {k: round(v, 3) for k, v in steady.items()},
        "overhead_pct_total": {k: round(100 * (total[k] / total["in_memory"] - 1), 1) for k in runs if k != "in_memory"},
        "overhead_pct_steady": {k: round(100 * (steady[k] / steady["in_memory"] - 1), 1)
                                for k in runs if k != "in_memory"},
    }, indent=2))

if __name__ == "__main__":
    main()
