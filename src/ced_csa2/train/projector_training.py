"""Projectors ``H_split -> K_l ‖ V_l`` fitted on the dump: the seed's AdamW recipe, or the ridge maps.

Shared by the ``train_projector`` stage (the source layer) and the ``extra_sources`` stage
(a covering plan's other attention layers above the cut).  Each projector is an
independent head: training several at once (one loss per head, summed) gives each the
same updates as training it alone on the same batches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import Params, ProjectorConfig
from ..data.loader import BlockLoader
from ..model_utils import Geometry, resolve_device
from ..pipeline import distributed
from ..projector import KVProjector
from . import training
from .training import Curves, Head, evaluate, fit, ridge_maps, val_summary, warmup_cosine

log = logging.getLogger(__name__)


def kv_names(layers) -> list[str]:
    """The dump datasets ``[k_l1, v_l1, k_l2, ...]`` that one projector head per layer predicts."""
    return [f"{kind}_{layer}" for layer in layers for kind in ("k", "v")]


def build_projectors(params: Params, layers: tuple[int, ...], hidden_size: int, kv_dim: int
                     ) -> dict[int, KVProjector]:
    """Seeded fresh projectors (PyTorch's default init, as in the seed), in ``layers`` order.

    ``train_projector.init: random``: training is then independent of ``ridge.lambda``
    (the ridge maps are only the closed-form baseline it is compared with).
    """
    torch.manual_seed(params.seed)
    return {layer: KVProjector(hidden_size, kv_dim) for layer in layers}


def heads_for(projectors: dict[int, KVProjector], kv_dim: int) -> list[Head]:
    """One head per projector: ``X = H_split``, ``Y = [K_l1 ‖ V_l1 ‖ K_l2 ‖ ...]``."""
    width = 2 * kv_dim
    return [Head({"layer": layer}, p.proj, x=slice(None), y=slice(i * width, (i + 1) * width),
                 parts={"k": slice(0, kv_dim), "v": slice(kv_dim, width)})
            for i, (layer, p) in enumerate(projectors.items())]


def ridge_projectors(path: Path, layers: list[int], geo: Geometry, params: Params) -> dict[int, KVProjector]:
    """Projectors set to the ridge stage's ``proj_{l}`` maps (the file checked against ``params``)."""
    maps = ridge_maps(path, [f"proj_{layer}" for layer in layers], params)
    out = {}
    for layer in layers:
        out[layer] = KVProjector(geo.hidden_size, geo.kv_dim)
        out[layer].init_from_ridge(maps[f"proj_{layer}"]["W"], maps[f"proj_{layer}"]["b"])
    return out


@dataclass
class Fitted:
    """Projectors and what fitting them measured."""

    projectors: dict[int, KVProjector]
    layers: dict[int, dict]  # per layer: held-out r2/cos/rel_mse/mse of K and V, val_loss(_init), maps
    curves: Curves  # per-epoch series (empty for ridge maps)
    run: dict  # steps, rows, device, ...


def train_projectors(params: Params, dump: Path, layers: tuple[int, ...], geo: Geometry, train_mask: np.ndarray,
                     val_mask: np.ndarray, desc: str, ridge: Path, cfg: ProjectorConfig | None = None) -> Fitted:
    """The seed's recipe (``train_projector``: MSE, AdamW, warm-up + cosine, autocast) for ``layers``.

    Starts from PyTorch's default init (``init: random``, the seed's) or from the ridge
    maps in ``ridge`` (``init: ridge``).  Validation (float32) on every row of ``val_mask``
    before training and after each epoch.  ``cfg`` replaces ``params.train_projector``
    (another recipe, e.g. the seed read literally, on the same params).
    """
    cfg = cfg or params.train_projector
    if cfg.init == "ridge":
        projectors = ridge_projectors(ridge, list(layers), geo, params)
    else:
        projectors = build_projectors(params, layers, geo.hidden_size, geo.kv_dim)
    device = distributed.local_device(resolve_device("auto"))
    for p in projectors.values():
        p.to(device)
    y_names = kv_names(layers)
    train = BlockLoader(dump, ["h_split"], y_names, train_mask, cfg.batch_size, shuffle=True, seed=params.seed)
    val = BlockLoader(dump, ["h_split"], y_names, val_mask, cfg.batch_size, shuffle=False, seed=params.seed)
    optimizer = torch.optim.AdamW([w for p in projectors.values() for w in p.parameters()], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    steps = cfg.epochs * len(train)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps, cfg.warmup_fraction))
    log.info("training projectors for layers %s on %s: %d train rows, %d val rows, %d steps, %s autocast",
             list(layers), device, train.n_rows, val.n_rows, steps, cfg.amp_dtype)
    curves, initial, final, kept = fit(heads_for(projectors, geo.kv_dim), optimizer, train, val, epochs=cfg.epochs,
                                       device=device, amp_dtype=cfg.amp_dtype, keep=cfg.keep, scheduler=scheduler,
                                       desc=desc)
    train.close()
    val.close()
    fitted = {layer: {**res, "val_loss": val_summary(res)[0], "val_loss_init": val_summary(init)[0], "maps": "trained",
                      "kept_epoch": epoch}
              for layer, res, init, epoch in zip(layers, final, initial, kept)}
    run = {"init": cfg.init, "keep": cfg.keep, "epochs": cfg.epochs, "batch_size": cfg.batch_size, "steps": steps,
           "train_rows": train.n_rows, "val_rows": val.n_rows, "device": device.type, "amp_dtype": cfg.amp_dtype,
           "compute_dtype": training.compute_dtype_name(device, cfg.amp_dtype)}
    return Fitted({layer: p.cpu() for layer, p in projectors.items()}, fitted, curves, run)


def ridge_fitted(params: Params, dump: Path, ridge: Path, layers: list[int], geo: Geometry,
                 val_mask: np.ndarray, batch_size: int) -> Fitted:
    """The ridge stage's maps for ``layers`` as projectors, validated on the rows of ``val_mask``."""
    projectors = ridge_projectors(ridge, layers, geo, params)
    val = BlockLoader(dump, ["h_split"], kv_names(layers), val_mask, batch_size, shuffle=False, seed=params.seed)
    results = evaluate(heads_for(projectors, geo.kv_dim), val, torch.device("cpu"))
    val.close()
    fitted = {layer: {**res, "val_loss": val_summary(res)[0], "maps": "ridge"} for layer, res in zip(layers, results)}
    return Fitted(projectors, fitted, {}, {"val_rows": val.n_rows})
