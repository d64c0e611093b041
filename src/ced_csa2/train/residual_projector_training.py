"""Training a :class:`~ced_csa2.maps.residual_projector.ResidualProjector`: the ridge map frozen, its MLP by K/V MSE.

:func:`train_residual_projector` starts from the ridge stage's map of the layer (the untrained head *is*
that map) and keeps the epoch of lowest held-out MSE, so the result is never worse than the ridge map on
the held-out rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import Params
from ..data.loader import BlockLoader
from ..maps.residual_projector import ResidualProjector
from ..model_utils import Geometry
from .projector_training import kv_names
from .training import Head, fit, ridge_maps, val_summary, warmup_cosine


@dataclass(frozen=True)
class HeadConfig:
    """How a :class:`ResidualProjector`'s MLP is trained (its base stays at the ridge map)."""

    epochs: int
    batch_size: int
    lr: float  # AdamW, warm-up + cosine (the seed's projector optimiser)
    weight_decay: float
    warmup_fraction: float
    activation: str = "gelu"


def train_residual_projector(params: Params, dump: Path, ridge: Path, layer: int, geo: Geometry, width: int,
                             cfg: HeadConfig, train_mask: np.ndarray, val_mask: np.ndarray
                             ) -> tuple[ResidualProjector, dict]:
    """A :class:`ResidualProjector` for ``layer`` from the ridge stage's map, its MLP trained by K/V MSE.

    AdamW over the MLP only (the base frozen at the ridge optimum), warm-up + cosine, float32;
    validation on every row of ``val_mask`` before training and after each epoch, the epoch of
    lowest held-out MSE kept (epoch 0 is the ridge map itself).

    Returns
    -------
    projector, fit
        ``fit``: held-out ``k``/``v`` metrics (r2, cos, rel_mse, mse) of the kept weights and of
        the start, ``val_loss`` / ``val_loss_init``, ``kept_epoch``, ``steps``, ``rows``.
    """
    torch.manual_seed(params.seed)  # the MLP's first layer: PyTorch's init, seeded
    projector = ResidualProjector(geo.hidden_size, geo.kv_dim, width, cfg.activation)
    maps = ridge_maps(ridge, [f"proj_{layer}"], params)[f"proj_{layer}"]
    projector.init_from_ridge(maps["W"], maps["b"])
    projector.head.base.requires_grad_(False)
    width2 = 2 * geo.kv_dim
    head = Head({"layer": layer, "width": width}, projector.head, x=slice(None), y=slice(0, width2),
                parts={"k": slice(0, geo.kv_dim), "v": slice(geo.kv_dim, width2)})
    train = BlockLoader(dump, ["h_split"], kv_names([layer]), train_mask, cfg.batch_size, shuffle=True, seed=params.seed)
    val = BlockLoader(dump, ["h_split"], kv_names([layer]), val_mask, cfg.batch_size, shuffle=False, seed=params.seed)
    optimizer = torch.optim.AdamW(projector.head.mlp.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = cfg.epochs * len(train)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps, cfg.warmup_fraction))
    try:
        _, initial, final, kept = fit([head], optimizer, train, val, epochs=cfg.epochs, device=torch.device("cpu"),
                                      amp_dtype="float32", keep="best_val", scheduler=scheduler,
                                      desc=f"residual projector, width {width}")
    finally:
        train.close()
        val.close()
    out = {**final[0], "init": initial[0], "val_loss": val_summary(final[0])[0],
           "val_loss_init": val_summary(initial[0])[0], "kept_epoch": kept[0], "steps": steps,
           "train_rows": train.n_rows, "val_rows": val.n_rows}
    return projector, out
