"""The CSA2 adapters' training: the dumped (source, target) K/V pairs, one head per target and
kind, the seed's SGD with its two learning rates.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import Params
from ..csa2 import CSA2Adapters
from ..data.loader import load_rows
from ..plan import LayerPlan
from .training import (
    KINDS,
    Head,
    pair_names,
)

GAIN_KEYS = ("r2", "cos", "rel_mse", "mse")


def load_pairs(dump: Path, plan: LayerPlan, mask, kv_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The masked rows as ``X (n, 2 kv_dim) = [K_src ‖ V_src]`` and ``Y (n, 2 kv_dim · targets)``."""
    x_names, y_names = pair_names(plan)
    data = load_rows(dump, x_names + y_names, mask)
    return data[:, :2 * kv_dim], data[:, 2 * kv_dim:]


def adapter_heads(adapters: CSA2Adapters, kv_dim: int) -> list[Head]:
    """One head per (target, kind), reading ``X`` (all of it, or its kind's half) and predicting its block of ``Y``."""
    heads = []
    for i, t in enumerate(adapters.layers):
        for j, kind in enumerate(KINDS):
            col = (2 * i + j) * kv_dim
            x = slice(None) if adapters.input == "kv" else slice(j * kv_dim, (j + 1) * kv_dim)
            heads.append(Head({"layer": t, "kind": kind}, adapters.adapter(kind, t), x=x, y=slice(col, col + kv_dim),
                              parts={kind: slice(None)}))
    return heads


def adapter_optimizer(adapters: CSA2Adapters, params: Params) -> torch.optim.SGD:
    """SGD with momentum: the bases at ``base_lr``, the residual MLPs at ``refine_lr``."""
    cfg = params.train_adapters
    base, mlp = [], []
    for kind in KINDS:
        for t in adapters.layers:
            b, m = adapters.adapter(kind, t).param_groups()
            base += b
            mlp += m
    return torch.optim.SGD([{"params": base, "lr": cfg.base_lr}, {"params": mlp, "lr": cfg.refine_lr}],
                           lr=cfg.base_lr, momentum=cfg.momentum)
