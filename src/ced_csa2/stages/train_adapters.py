"""``train_adapters`` stage: the CSA2 adapters ``KV_source -> KV_t`` of each target layer.

    python -m ced_csa2.stages.train_adapters      # what `dvc repro train_adapters` runs

Reads ``params.yaml``, ``data/dump/dump.h5`` and ``models/ridge.pt``.  Validates the
plan and the dump first; splits the records as the ridge stage does, samples
``split.tokens_per_record`` token pairs per record on each side
(:func:`ced_csa2.data.loader.row_mask`) and holds them in memory.  Each target layer gets a
K and a V :class:`~ced_csa2.csa2.KVAdapter` whose base starts at the ridge maps
``k_{t}`` / ``v_{t}`` (so training starts *at* the ridge solution); all of them train
in one loop, on the same batches:

* loss: MSE; SGD with ``momentum`` and two parameter groups, the Linear bases at
  ``base_lr`` and the residual MLPs at ``refine_lr`` (constant: the seed names no
  schedule); ``torch.autocast`` in ``amp_dtype`` (none for float32); ``epochs`` passes of
  ``batch_size`` pairs; seeded (``params.seed``);
* validation (float32) on the held-out pairs before training -- which is the ridge
  solution's fit -- and after each epoch;
* data-parallel (``distributed.nproc``): every rank holds all pairs and trains on its
  slice of every global batch under ``DistributedDataParallel`` (:mod:`ced_csa2.train.training`),
  so the batches, their order and the steps are those of one process; rank 0 writes.

Writes ``models/adapters.pt``, the curves
``metrics/curves/train_adapters.tsv`` (series ``layer{t}_{k,v}``, one per adapter: ``train_loss``,
``val_loss``, ``val_cos`` by epoch; ``val_*`` from epoch 0, the ridge start) and
``metrics/adapters.json``: per layer and K/V the
r2, cos, rel_mse, mse of the trained adapter (``trained``), of the ridge-only start on
the same pairs (``ridge``), and ``gain = trained - ridge`` (positive is better for r2
and cos, negative for rel_mse and mse); plus run facts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from ..config import Params, provenance
from ..csa2 import save_adapters
from ..maps.ridge import ridge_provenance
from ..model_utils import resolve_device
from ..pipeline import distributed
from ..pipeline.atomic_files import write_json
from ..pipeline.checkpoint import checkpoint_meta
from ..pipeline.map_roles import MAIN
from ..pipeline.paths import ADAPTERS_CURVES, ADAPTERS_METRICS, ADAPTERS_PATH, DUMP_PATH, RIDGE_PATH
from ..pipeline.stage_runner import run_stage, stage_arguments
from ..plan import load_plan
from ..train.adapter_training import GAIN_KEYS, adapter_heads, adapter_optimizer, load_pairs
from ..train.training import (
    TensorBatches,
    build_adapters,
    compute_dtype_name,
    fit,
    split_masks,
    write_curves,
)

log = logging.getLogger(__name__)

PROVENANCE = ("seed", "model", "plan", "split", "ridge", "train_adapters")  # of dvc.yaml's params for train_adapters


def run(params: Params, workdir: Path = Path(".")) -> dict:
    """Train, validate and save the adapters; returns the metrics written to ``metrics/adapters.json``."""
    with distributed.session(params.distributed):
        return _run(params, Path(workdir))


def _run(params: Params, workdir: Path) -> dict:
    cfg = params.train_adapters
    plan, geo = load_plan(params.plan, params.model)
    dump, kv = workdir / DUMP_PATH, geo.kv_dim
    train_mask, val_mask = split_masks(dump, params, plan, geo, (plan.source, *plan.targets),
                                       params.split.tokens_per_record)
    adapters = build_adapters(params, plan, kv, workdir / RIDGE_PATH)
    device = distributed.local_device(resolve_device("auto"))
    adapters.to(device)

    train = TensorBatches(*load_pairs(dump, plan, train_mask, kv), cfg.batch_size, shuffle=True, seed=params.seed)
    val = TensorBatches(*load_pairs(dump, plan, val_mask, kv), cfg.batch_size, shuffle=False, seed=params.seed)
    log.info("training adapters KV_%d -> KV_%s on %s: %d train pairs, %d val pairs, MLP width %d, %s autocast",
             plan.source, list(plan.targets), device, train.n_rows, val.n_rows, adapters.width, cfg.amp_dtype)
    heads = adapter_heads(adapters, kv)
    curves, ridge, trained, kept = fit(heads, adapter_optimizer(adapters, params), train, val, epochs=cfg.epochs,
                                       device=device, amp_dtype=cfg.amp_dtype, keep=cfg.keep, desc="train_adapters")

    made_from = {**ridge_provenance(workdir / RIDGE_PATH), **provenance(params, *PROVENANCE)}
    meta = checkpoint_meta(params, plan, geo, params.model, params.plan, params.split, params.ridge,
                           params.train_adapters, role=MAIN, provenance=made_from)["adapters"]

    layers: dict[str, dict] = {}
    for h, r, tr, epoch in zip(heads, ridge, trained, kept):
        kind = h.label["kind"]
        layers.setdefault(str(h.label["layer"]), {})[kind] = {
            "trained": tr[kind], "ridge": r[kind], "gain": {k: tr[kind][k] - r[kind][k] for k in GAIN_KEYS},
            "kept_epoch": epoch}
    metrics = {
        "layers": layers,
        "run": {"epochs": cfg.epochs, "keep": cfg.keep, "steps": cfg.epochs * len(train), "train_pairs": train.n_rows,
                "val_pairs": val.n_rows, "width": adapters.width, "device": device.type,
                "amp_dtype": cfg.amp_dtype, "compute_dtype": compute_dtype_name(device, cfg.amp_dtype)},
    }
    if distributed.is_main():
        save_adapters(workdir / ADAPTERS_PATH, adapters.cpu(), meta)
        write_curves(workdir / ADAPTERS_CURVES, curves, x="epoch")
        write_json(workdir / ADAPTERS_METRICS, metrics)
    for t, m in layers.items():
        log.info("adapters KV_%d -> KV_%s: val R2 K %.4f (ridge %.4f), V %.4f (ridge %.4f)", plan.source, t,
                 m["k"]["trained"]["r2"], m["k"]["ridge"]["r2"], m["v"]["trained"]["r2"], m["v"]["ridge"]["r2"])
    return metrics


def main(argv: Sequence[str] | None = None) -> None:
    run_stage(run, *stage_arguments(run, argv), launcher=distributed.relaunch)


if __name__ == "__main__":
    main()
