"""Projector training throughput: the HDF5 block loader vs the same rows preloaded in memory.

    python benchmarks/train_throughput.py                      # data/dump/dump.h5, params.yaml
    python benchmarks/train_throughput.py --records 64 --epochs 16

Three runs train the stage's own projector (same heads, optimizer, schedule, autocast
and batch size, via :func:`ced_csa2.train.training.train_epoch`) on the train rows of the
first ``--records`` records: from tensors loaded up front (``TensorBatches``, the
baseline), and with ``BlockLoader`` streaming every epoch from the dump
(``preload_bytes=0``) and with its default (rows read once on the first epoch, then
gathered from memory).  The three advance one epoch each in turn: the first epoch of each
(its warm-up; the preloading loader's read) timed once, then the rest through
:func:`ced_csa2.pipeline.timing.paired_seconds` (``warmup=False``: the first epoch was it; order
rotated every round, per-run median).  Reported: total seconds including loading and the
first epoch, the median epoch after the first, and each loader's overhead over the
baseline on both.  Goal: overhead <= 20%.  ``--epochs`` >= 4 (a median of >= 3).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from ced_csa2.config import load_params
from ced_csa2.data.dump_file import DumpReader
from ced_csa2.data.loader import BlockLoader, load_rows, record_split
from ced_csa2.model_utils import resolve_device
from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.study_runner import run_main
from ced_csa2.pipeline.timing import Clock, paired_seconds
from ced_csa2.plan import LayerPlan
from ced_csa2.train.projector_training import build_projectors, heads_for
from ced_csa2.train.training import TensorBatches, train_epoch

DUMP = "data/dump/dump.h5"


class Trainer:
    """Fresh projectors trained over ``batches``, one epoch per :meth:`epoch` call."""

    def __init__(self, params, plan, geo_dims, batches, device):
        projectors = build_projectors(params, (plan.source,), *geo_dims)
        self.heads = heads_for(projectors, geo_dims[1])
        self.opt = torch.optim.AdamW([p for pr in projectors.values() for p in pr.parameters()],
                                     lr=params.train_projector.lr, weight_decay=params.train_projector.weight_decay)
        self.params, self.batches, self.device, self.done = params, batches, device, 0

    def epoch(self) -> None:
        self.batches.set_epoch(self.done)
        train_epoch(self.heads, self.opt, self.batches, self.device, self.params.train_projector.amp_dtype)
        self.done += 1


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    load = {"in_memory": time.perf_counter() - t, "loader_streamed": 0.0, "loader_preloaded": 0.0}
    sources = {"in_memory": TensorBatches(X, Y, bs, shuffle=True, seed=params.seed)}
    for name, preload in (("loader_streamed", 0), ("loader_preloaded", None)):
        sources[name] = BlockLoader(DUMP, ["h_split"], y, mask, bs, shuffle=True, seed=params.seed,
                                    preload_bytes=preload)
    trainers = {name: Trainer(params, plan, dims, batches, device) for name, batches in sources.items()}
    clock, first = Clock(device), {}
    for name, trainer in trainers.items():
        t = clock()
        trainer.epoch()
        first[name] = clock() - t
    timed = paired_seconds({name: tr.epoch for name, tr in trainers.items()}, args.epochs - 1, warmup=False,
                           device=device)
    for batches in sources.values():
        getattr(batches, "close", lambda: None)()
    total = {name: load[name] + first[name] + sum(timed.runs[name]) for name in trainers}
    steady = timed.seconds
    print(json.dumps({
        "rows": int(mask.sum()), "epochs": args.epochs, "batch_size": bs, "device": str(device),
        "threads": torch.get_num_threads(), "amp_dtype": params.train_projector.amp_dtype,
        "in_memory_load_seconds": round(load["in_memory"], 2),
        "total_seconds_incl_loading": {k: round(v, 2) for k, v in total.items()},
        "steady_epoch_seconds": {k: round(v, 3) for k, v in steady.items()},
        "overhead_pct_total": {k: round(100 * (total[k] / total["in_memory"] - 1), 1) for k in total
                               if k != "in_memory"},
        "overhead_pct_steady": {k: round(100 * (steady[k] / steady["in_memory"] - 1), 1)
                                for k in steady if k != "in_memory"},
    }, indent=2))

if __name__ == "__main__":
    run_main(main)
