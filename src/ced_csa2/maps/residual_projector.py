"""A CED projector that is not linear: the ridge map plus a zero-initialised residual MLP.

Every *linear* projector ``H_split -> KV_source`` lands on the ridge optimum, and the seed's AdamW
from there only adds noise (``docs/results.md``).
:class:`ResidualProjector` gives the map the CSA2 adapters' form (:class:`~ced_csa2.csa2.KVAdapter`):
``[K ‖ V] = base(h) + mlp(h)``, ``base`` the ridge map and ``mlp`` a ``Linear -> act -> Linear``
whose last layer starts at zero, so the untrained head *is* the ridge map, bit for bit, and
training can only move it to a lower held-out loss (the epoch of lowest held-out MSE is kept).
The base stays frozen at the ridge optimum
(:func:`ced_csa2.train.residual_projector_training.train_residual_projector`): what the MLP
learns is what a linear map cannot.

Parameters per head: ``2·kv_dim·(hidden + 1)`` (the base) ``+ width·(hidden + 1) + 2·kv_dim·(width
+ 1)`` (the MLP).  It is a prefill-time cost only (one more ``hidden -> width -> 2 kv_dim`` matmul
per token at the cut); nothing more is stored per token.
"""

from __future__ import annotations

import torch
from torch import nn

from ..csa2 import KVAdapter


class ResidualProjector(nn.Module):
    """``H_split -> (K, V)``: ``base(h) + mlp(h)`` split into ``K ‖ V``, each ``(..., kv_dim)``.

    Parameters
    ----------
    hidden_size, kv_dim
        Widths of ``H_split`` and of the source layer's K (= V).
    width
        Hidden width of the residual MLP.
    activation
        The MLP's activation (:data:`ced_csa2.csa2.ACTIVATIONS`).
    """

    def __init__(self, hidden_size: int, kv_dim: int, width: int, activation: str = "gelu"):
        super().__init__()
        self.kv_dim, self.width = kv_dim, width
        self.head = KVAdapter(2 * kv_dim, width, activation, in_dim=hidden_size)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.head(h).split(self.kv_dim, dim=-1)
        return k, v

    def init_from_ridge(self, W: torch.Tensor, b: torch.Tensor) -> None:
        """The base from the ridge map ``W`` ``(hidden, 2 kv_dim)``, ``b`` ``(2 kv_dim,)``; the MLP adds exact zeros."""
        self.head.init_from_ridge(W, b)

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())
