"""CED projector: the split layer's hidden state straight to the source layer's K/V.

``KVProjector`` is one ``Linear(hidden -> 2 * kv_dim)`` whose output is ``K ‖ V`` of the
projected layer (pre-k_norm, pre-RoPE, as ``k_proj``/``v_proj`` emit them).  On
Qwen3.5-4B that is ``Linear(2560 -> 2048)``: 5,244,928 parameters, ~10 MB in FP16.
With ``mlp_width > 0`` (Mode A's maps, ``mode_a.train.head_width``) a zero-initialised
residual MLP reads the *standardised* ``H_split`` and adds to the linear map, so the untrained
head is the linear map bit for bit.  Why standardised: ``H_split`` has outlier channels
(SmolLM2's layer 15: one channel's std 1,118 against a median 4), and AdamW moves every first-layer
weight by ~lr, so on raw inputs the MLP's output jumps by hundreds per step (measured: Mode A's
training KL 0.83 -> 10.7 in one step at lr 3e-4).

Files hold FP16 weights and metadata (format and load-time checks in
:mod:`ced_csa2.pipeline.checkpoint`): ``models/projector_k{l}v{l}.pt`` for the source layer
(:func:`save_projector` / :func:`load_projector`), and ``models/projectors_extra.pt``
for a covering plan's extra sources, several projectors in one file
(:func:`save_projectors` / :func:`load_projectors`; empty for an ordinary plan).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from .csa2 import ResidualMLP
from .pipeline.checkpoint import init_linear_from_ridge, load_checkpoint, load_state, save_checkpoint

KIND = "projector"
KIND_MANY = "projectors"  # one file of several single-layer projectors
# What a projector file must say about itself besides its dims (added by save_projector):
# see ced_csa2.pipeline.checkpoint.expected_meta / checkpoint_meta.
REQUIRED_META = ("layer", "split", "plan", "model", "model_id", "params_hash")


class KVProjector(nn.Module):
    """``H_split -> (K_l, V_l)`` with one linear map.

    Parameters
    ----------
    hidden_size
        Width of ``H_split``.
    kv_dim
        ``n_kv_heads * head_dim`` of the projected layer.
    mlp_width
        Hidden width of the residual MLP (0: none, the linear map alone).
    activation
        The MLP's activation (:data:`ced_csa2.csa2.ACTIVATIONS`).
    device, dtype
        Passed to the modules (``device="meta"`` builds them without memory).
    """

    def __init__(self, hidden_size: int, kv_dim: int, *, mlp_width: int = 0, activation: str = "gelu",
                 device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.kv_dim, self.mlp_width, self.activation = hidden_size, kv_dim, mlp_width, activation
        self.proj = nn.Linear(hidden_size, 2 * kv_dim, device=device, dtype=dtype)
        self.mlp = None
        if mlp_width:
            self.mlp = ResidualMLP(2 * kv_dim, mlp_width, activation, in_dim=hidden_size, device=device, dtype=dtype)
            # per-channel mean and std of H_split (set_input_stats): the MLP reads (h - mean) / std
            self.register_buffer("h_mean", torch.zeros(hidden_size, device=device, dtype=dtype))
            self.register_buffer("h_std", torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h``: ``(..., hidden)`` -> ``(k, v)``, each ``(..., kv_dim)`` (views of one output)."""
        out = self.proj(h)
        if self.mlp is not None:
            out = out + self.mlp((h - self.h_mean) / self.h_std)
        k, v = out.split(self.kv_dim, dim=-1)
        return k, v

    def set_input_stats(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """The MLP's input standardisation, ``mean``/``std`` ``(hidden,)``, rounded to FP16 as the file stores them.

        Rounded here so that the head trained is the head a file reloads.
        """
        if self.mlp is None:
            raise ValueError("KVProjector.set_input_stats: a projector without an MLP has no input standardisation")
        if not bool((std > 0).all()):
            raise ValueError("KVProjector.set_input_stats: every channel's std must be > 0")
        self.h_mean.copy_(mean.to(torch.float16))
        self.h_std.copy_(std.to(torch.float16))

    def mlp_parameters(self) -> list[nn.Parameter]:
        """The residual MLP's parameters (empty for a linear projector)."""
        return [] if self.mlp is None else list(self.mlp.parameters())

    def init_from_ridge(self, W: torch.Tensor, b: torch.Tensor) -> None:
        """Start from the closed-form solution: ``W`` ``(hidden, 2 kv_dim)``, ``b`` ``(2 kv_dim,)``."""
        init_linear_from_ridge(self.proj, W, b)


def save_projector(path: str | Path, projector: KVProjector, meta: Mapping) -> Path:
    """Write ``projector`` (FP16 weights) and ``meta`` to ``path`` atomically.

    ``meta`` must hold :data:`REQUIRED_META` (layer, split, plan, model, model_id,
    params_hash; :func:`ced_csa2.pipeline.checkpoint.checkpoint_meta` gives them); ``hidden_size``
    and ``kv_dim`` are taken from the module, so the file describes the weights it holds.
    """
    return save_checkpoint(path, KIND, projector, {**meta, **_shape(projector)}, REQUIRED_META)


def _shape(projector: KVProjector) -> dict:
    """What a file says about a projector's form (its dims and head), so that loading can rebuild it."""
    return {"hidden_size": projector.hidden_size, "kv_dim": projector.kv_dim, "mlp_width": projector.mlp_width,
            "activation": projector.activation}


def _empty(meta: Mapping) -> KVProjector:
    """An unfilled projector of the form ``meta`` describes (a file without ``mlp_width`` holds a linear map)."""
    return KVProjector(meta["hidden_size"], meta["kv_dim"], mlp_width=meta.get("mlp_width", 0),
                       activation=meta.get("activation", "gelu"), device="meta")


def load_projector(path: str | Path, *, expect: Mapping | None = None, device=None,
                   dtype: torch.dtype | None = None) -> tuple[KVProjector, dict]:
    """Load a projector file.

    Parameters
    ----------
    path
        A file written by :func:`save_projector`.
    expect
        Metadata the file must match, e.g. ``{"hidden_size": 2560, "kv_dim": 1024,
        "layer": 20, "model": "qwen3_5_4b"}`` (the pipeline passes
        ``expected_meta(...)["projector"]``, see :func:`ced_csa2.pipeline.checkpoint.expected_meta`);
        a mismatch raises :class:`~ced_csa2.pipeline.checkpoint.CheckpointError` naming the file,
        key and both values, before any weight is read into a module.
    device, dtype
        Where and in what dtype to build the module (default: CPU, float32 -- which
        holds the stored FP16 values exactly).

    Returns
    -------
    (projector, meta)
        The module in eval mode and the file's metadata dict.
    """
    state, meta = load_checkpoint(path, KIND, expect)
    projector = _empty(meta)
    projector.to_empty(device="cpu")
    load_state(Path(path), projector, state)
    return projector.to(device=device, dtype=dtype or torch.float32).eval(), meta


def save_projectors(path: str | Path, projectors: Mapping[int, KVProjector], meta: Mapping) -> Path:
    """Write several single-layer projectors (the extra sources of a covering plan) to one file.

    ``meta`` must hold :data:`REQUIRED_META` except ``layer``, plus ``hidden_size`` and
    ``kv_dim`` (an empty file still says what it is for); ``layers`` comes from the keys.
    Every projector must have those dims and one head form (``mlp_width``, ``activation``).
    """
    forms = {(p.mlp_width, p.activation) for p in projectors.values()}
    if len(forms) > 1:
        raise ValueError(f"{path}: the projectors have different heads {sorted(forms)}; one file holds one form")
    for layer, p in projectors.items():
        if (p.hidden_size, p.kv_dim) != (meta.get("hidden_size"), meta.get("kv_dim")):
            raise ValueError(f"{path}: projector of layer {layer} is {p.hidden_size} -> 2x{p.kv_dim}, meta says "
                             f"{meta.get('hidden_size')} -> 2x{meta.get('kv_dim')}")
    if projectors:
        meta = {**meta, **_shape(next(iter(projectors.values())))}
    module = nn.ModuleDict({str(layer): p for layer, p in projectors.items()})
    required = tuple(k for k in REQUIRED_META if k != "layer") + ("hidden_size", "kv_dim")
    return save_checkpoint(path, KIND_MANY, module, {**meta, "layers": [int(k) for k in projectors]}, required)


def load_projectors(path: str | Path, *, expect: Mapping | None = None, device=None,
                    dtype: torch.dtype | None = None) -> tuple[dict[int, KVProjector], dict]:
    """Load a file of :func:`save_projectors`: ``({layer: projector}, meta)``, as :func:`load_projector` does."""
    state, meta = load_checkpoint(path, KIND_MANY, expect)
    module = nn.ModuleDict({str(layer): _empty(meta) for layer in meta["layers"]})
    module.to_empty(device="cpu")
    load_state(Path(path), module, state)
    module = module.to(device=device, dtype=dtype or torch.float32).eval()
    return {int(layer): p for layer, p in module.items()}, meta
