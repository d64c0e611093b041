"""Projector training throughput: the HDF5 block loader vs the same rows preloaded in memory.

    python benchmarks/train_throughput.py                      # data/dump/dump.h5, params.yaml
    python benchmarks/train_throughput.py --records 200 --epochs 2

Both runs train the stage's own projector (same heads, optimizer, schedule, autocast
and batch size, via :func:`ced_csa2.training.train_epoch`) on the train rows of the
first ``--records`` records: once streaming from the dump with ``BlockLoader``
(chunk-aligned block reads, block-level shuffle), once from tensors loaded up front
(``TensorBatches``).  Loading time is reported separately and not counted.  Goal:
loader overhead <= 20%.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from ced_csa2.config import load_params
from ced_csa2.h5store import DumpReader
from ced_csa2.loader import BlockLoader, load_rows, record_split
from ced_csa2.model_utils import resolve_device
from ced_csa2.plan import LayerPlan
from ced_csa2.stages.train_projector import build_projectors, heads_for
from ced_csa2.training import TensorBatches, train_epoch

DUMP = "data/dump/dump.h5"


def samples_per_s(params, plan, geo_dims, batches, epochs, device) -> float:
    """Train fresh projectors for ``epochs`` over ``batches``; rows per second."""
    projectors = build_projectors(params, plan.projected, *geo_dims)
    heads = heads_for(projectors, geo_dims[1])
    opt = torch.optim.AdamW([p for pr in projectors.values() for p in pr.parameters()],
                            lr=params.train_projector.lr, weight_decay=params.train_projector.weight_decay)
    rows, t = 0, time.perf_counter()
    for epoch in range(epochs):
        batches.set_epoch(epoch)
        train_epoch(heads, opt, batches, device, params.train_projector.amp_dtype)
        rows += batches.n_rows
    return rows / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=200)
    ap.add_argument("--epochs", type=int, default=2)
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
    y = [f"{kind}_{layer}" for layer in plan.projected for kind in "kv"]
    bs = params.train_projector.batch_size

    t = time.perf_counter()
    X, Y = load_rows(DUMP, ["h_split"], mask), load_rows(DUMP, y, mask)
    preload_s = time.perf_counter() - t
    mem = samples_per_s(params, plan, dims, TensorBatches(X, Y, bs, shuffle=True, seed=params.seed), args.epochs,
                        device)
    loader = BlockLoader(DUMP, ["h_split"], y, mask, bs, shuffle=True, seed=params.seed)
    hdf5 = samples_per_s(params, plan, dims, loader, args.epochs, device)
    loader.close()
    print(json.dumps({
        "rows": int(mask.sum()), "epochs": args.epochs, "batch_size": bs, "device": str(device),
        "threads": torch.get_num_threads(), "amp_dtype": params.train_projector.amp_dtype,
        "preload_seconds": round(preload_s, 2),
        "in_memory_samples_per_s": round(mem, 1), "hdf5_loader_samples_per_s": round(hdf5, 1),
        "loader_overhead_pct": round(100 * (mem / hdf5 - 1), 1),
    }, indent=2))


if __name__ == "__main__":
    main()
