"""``train_projector`` stage: the CED projector ``H_split -> K_l ‖ V_l`` of each projected layer.

    python -m ced_csa2.stages.train_projector     # what `dvc repro train_projector` runs

Reads ``params.yaml`` and ``data/dump/dump.h5``.  Validates the plan and the dump first;
splits the records as the ridge stage does (:func:`ced_csa2.loader.record_split`) and trains one
:class:`~ced_csa2.projector.KVProjector` per layer of ``plan.projected`` (the source,
then a covering plan's extra sources) on every token of the training records, all in
one pass over the data per epoch:

* loss: MSE on ``K ‖ V``; AdamW (``lr``, ``weight_decay``); linear warm-up over
  ``warmup_fraction`` of the steps, then cosine decay to 0; ``torch.autocast`` in
  ``amp_dtype`` (none for float32); ``epochs`` passes of ``batch_size`` rows;
* seeded (``params.seed``): initial weights, shuffling, split;
* validation (float32) on every token of the held-out records, before training and
  after each epoch.

Writes ``models/projector_k{src}v{src}.pt`` (the source), ``models/projectors_extra.pt``
(the extra sources; written, empty, for an ordinary plan), the curves
``metrics/curves/train_projector/layer{l}_{train_loss,val_loss,val_cos}.tsv`` (one series
per file, x = epoch, ``val_*`` from epoch 0 = before training; ``val_*`` are means of the
K and V halves) and ``metrics/projector.json`` (per layer: r2, cos, rel_mse, mse for K and V,
and the val loss before and after training; plus run facts and wall time).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..checkpoint import checkpoint_meta
from ..config import Params
from ..entry import run_stage
from ..io_utils import write_json
from ..loader import BlockLoader
from ..model_utils import resolve_device
from ..paths import DUMP_PATH, PROJECTOR_CURVES, PROJECTOR_METRICS, PROJECTORS_EXTRA, projector_path
from ..plan import load_plan
from ..projector import KVProjector, save_projector, save_projectors
from ..training import Head, fit, split_masks, val_summary, warmup_cosine, write_curves

log = logging.getLogger(__name__)


def build_projectors(params: Params, layers: tuple[int, ...], hidden_size: int, kv_dim: int
                     ) -> dict[int, KVProjector]:
    """Seeded fresh projectors (PyTorch's default init, as in the seed), in ``layers`` order.

    The ridge stage's ``proj_*`` maps are the closed-form baseline they are compared
    with, not their initialisation: that keeps this stage independent of ``ridge.lambda``.
    """
    torch.manual_seed(params.seed)
    return {layer: KVProjector(hidden_size, kv_dim) for layer in layers}


def heads_for(projectors: dict[int, KVProjector], kv_dim: int) -> list[Head]:
    """One head per projector: ``X = H_split``, ``Y = [K_l1 ‖ V_l1 ‖ K_l2 ‖ ...]``."""
    width = 2 * kv_dim
    return [Head({"layer": layer}, p.proj, x=slice(None), y=slice(i * width, (i + 1) * width),
                 parts={"k": slice(0, kv_dim), "v": slice(kv_dim, width)})
            for i, (layer, p) in enumerate(projectors.items())]


def run(params: Params, workdir: Path = Path(".")) -> dict:
    """Train, validate and save the projectors; returns the metrics written to ``metrics/projector.json``."""
    workdir, t0 = Path(workdir), time.perf_counter()
    cfg = params.train_projector
    plan, geo = load_plan(params.plan, params.model)
    dump = workdir / DUMP_PATH
    train_mask, val_mask = split_masks(dump, params, plan, geo, plan.projected, tokens_per_record=0)
    projectors = build_projectors(params, plan.projected, geo.hidden_size, geo.kv_dim)
    device = resolve_device("auto")
    for p in projectors.values():
        p.to(device)

    y_names = [f"{kind}_{layer}" for layer in plan.projected for kind in ("k", "v")]
    train = BlockLoader(dump, ["h_split"], y_names, train_mask, cfg.batch_size, shuffle=True, seed=params.seed)
    val = BlockLoader(dump, ["h_split"], y_names, val_mask, cfg.batch_size, shuffle=False, seed=params.seed)
    params_list = [w for p in projectors.values() for w in p.parameters()]
    optimizer = torch.optim.AdamW(params_list, lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = cfg.epochs * len(train)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps, cfg.warmup_fraction))
    log.info("training projectors for layers %s from H_%d on %s: %d train rows, %d val rows, %d steps, %s autocast",
             list(plan.projected), plan.split, device, train.n_rows, val.n_rows, steps, cfg.amp_dtype)
    heads = heads_for(projectors, geo.kv_dim)
    curves, initial, final = fit(heads, optimizer, train, val, epochs=cfg.epochs, device=device,
                               amp_dtype=cfg.amp_dtype, scheduler=scheduler, desc="train_projector")
    train.close()
    val.close()

    meta = checkpoint_meta(params, plan, geo, params.model, params.plan, params.split, params.train_projector)
    source, *extra = plan.projected
    save_projector(workdir / projector_path(source), projectors[source].cpu(), meta["projector"])
    save_projectors(workdir / PROJECTORS_EXTRA, {layer: projectors[layer].cpu() for layer in extra},
                    meta["projectors"])

    metrics = {
        "layers": {str(layer): {**res, "val_loss": val_summary(res)[0], "val_loss_init": val_summary(init)[0]}
                   for layer, res, init in zip(plan.projected, final, initial)},
        "run": {"epochs": cfg.epochs, "steps": steps, "train_rows": train.n_rows, "val_rows": val.n_rows,
                "device": device.type, "amp_dtype": cfg.amp_dtype,
                "wall_s": round(time.perf_counter() - t0, 3)},
    }
    write_curves(workdir / PROJECTOR_CURVES, curves, x="epoch")
    write_json(workdir / PROJECTOR_METRICS, metrics)
    for layer, m in metrics["layers"].items():
        log.info("projector H_%d -> KV_%s: val R2 K %.4f V %.4f, cos K %.4f V %.4f", plan.split, layer,
                 m["k"]["r2"], m["v"]["r2"], m["k"]["cos"], m["v"]["cos"])
    return metrics


def main() -> None:
    run_stage(run)


if __name__ == "__main__":
    main()
