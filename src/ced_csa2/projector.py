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

``ProjectorBank`` (Mode A's maps with ``mode_a.train.rank > 0``) serves several layers through one
shared basis: ``Linear(hidden -> rank)``, then one ``Linear(rank -> 2 * kv_dim)`` per layer, all
layers' heads in one matrix.  Why: Mode A computes every projected layer's K/V from the same
``H_split``, and on the embedded default those maps were a measurable part of the skip's time (12
layers x ``576 x 384``: as many multiply-adds per token as ~0.75 of a decoder layer; ``docs/costs.md``);
at rank 256 (the CPU budget's) they cost half of that.  :func:`reduced_rank` starts it at the reduced-rank regression of the per-layer maps.

Files hold FP16 weights and metadata (format and load-time checks in
:mod:`ced_csa2.pipeline.checkpoint`): ``models/projector_k{l}v{l}.pt`` for the source layer
(:func:`save_projector` / :func:`load_projector`), and ``models/projectors_extra.pt``
for a covering plan's extra sources, several projectors in one file
(:func:`save_projectors` / :func:`load_projectors`; empty for an ordinary plan), and
``models/mode_a/projector_bank.pt`` for a bank (:func:`save_bank` / :func:`load_bank`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from .csa2 import ResidualMLP
from .pipeline.checkpoint import init_linear_from_ridge, load_checkpoint, load_state, save_checkpoint
from .pipeline.map_roles import Role

KIND = "projector"
KIND_MANY = "projectors"  # one file of several single-layer projectors
KIND_BANK = "projector_bank"  # one file of a ProjectorBank
# What a projector file must say about itself besides its dims (added by save_projector):
# see ced_csa2.pipeline.checkpoint.expected_meta / checkpoint_meta.
REQUIRED_META = ("role", "layer", "split", "plan", "model", "model_id", "params_hash")


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

    ``meta`` must hold :data:`REQUIRED_META` (role, layer, split, plan, model, model_id,
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


def load_projector(path: str | Path, *, role: Role, expect: Mapping | None = None, device=None,
                   dtype: torch.dtype | None = None, revision: str | None = None) -> tuple[KVProjector, dict]:
    """Load a projector file, or a release's projector.

    Parameters
    ----------
    path
        A file written by :func:`save_projector`; or a release folder or hub id (with ``revision``), whose main
        projector is read after the release's own checks (:func:`ced_csa2.release.load_main_map`).
    role
        The branch it must belong to (:mod:`ced_csa2.pipeline.map_roles`): another one is refused
        naming the file and both roles, before its tensors are read.
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
    from . import release  # the release reads this module's classes: imported when used

    if release.is_release(path, revision):
        return release.load_main_map(path, KIND, role=role, expect=expect, revision=revision, device=device,
                                     dtype=dtype)
    state, meta = load_checkpoint(path, KIND, expect, role=role)
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


def load_projectors(path: str | Path, *, role: Role, expect: Mapping | None = None, device=None,
                    dtype: torch.dtype | None = None) -> tuple[dict[int, KVProjector], dict]:
    """Load a file of :func:`save_projectors`: ``({layer: projector}, meta)``, as :func:`load_projector` does."""
    state, meta = load_checkpoint(path, KIND_MANY, expect, role=role)
    module = nn.ModuleDict({str(layer): _empty(meta) for layer in meta["layers"]})
    module.to_empty(device="cpu")
    load_state(Path(path), module, state)
    module = module.to(device=device, dtype=dtype or torch.float32).eval()
    return {int(layer): p for layer, p in module.items()}, meta


class ProjectorBank(nn.Module):
    """``H_split -> {layer: (K_l, V_l)}`` for several layers through one shared rank-``rank`` basis.

    ``heads(basis(h))`` holds every layer's ``K ‖ V``, the layers in ``layers`` order; layer ``l``'s
    map is ``heads_l ∘ basis``, a linear map of rank at most ``rank``.

    Parameters
    ----------
    hidden_size
        Width of ``H_split``.
    kv_dim
        ``n_kv_heads * head_dim`` of every projected layer.
    layers
        The layers it projects.
    rank
        Width of the shared basis, at least 1 (a bank is cheaper than the per-layer maps it factors
        while ``rank * (hidden + 2 * kv_dim * len(layers)) < hidden * 2 * kv_dim * len(layers)``).
    device, dtype
        Passed to the modules.
    """

    def __init__(self, hidden_size: int, kv_dim: int, layers, rank: int, *, device=None, dtype=None):
        super().__init__()
        if rank < 1:
            raise ValueError(f"ProjectorBank: rank must be >= 1, got {rank}")
        self.hidden_size, self.kv_dim, self.layers, self.rank = hidden_size, kv_dim, tuple(layers), rank
        self.basis = nn.Linear(hidden_size, rank, bias=False, device=device, dtype=dtype)
        self.heads = nn.Linear(rank, len(self.layers) * 2 * kv_dim, device=device, dtype=dtype)

    def forward(self, h: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """``h``: ``(..., hidden)`` -> ``{layer: (k, v)}``, each ``(..., kv_dim)`` (views of one output)."""
        out = self.heads(self.basis(h)).split(2 * self.kv_dim, dim=-1)
        return {layer: tuple(kv.split(self.kv_dim, dim=-1)) for layer, kv in zip(self.layers, out)}

    def project(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of ``layer`` alone (its rows of the heads): ``h`` ``(..., hidden)`` -> each ``(..., kv_dim)``."""
        rows = slice(self.layers.index(layer) * 2 * self.kv_dim, (self.layers.index(layer) + 1) * 2 * self.kv_dim)
        k, v = nn.functional.linear(self.basis(h), self.heads.weight[rows], self.heads.bias[rows]).split(self.kv_dim, -1)
        return k, v


@torch.no_grad()
def reduced_rank(projectors: Mapping[int, KVProjector], mean: torch.Tensor, cov: torch.Tensor,
                 rank: int) -> ProjectorBank:
    """The bank of rank ``rank`` closest to the linear ``projectors`` on inputs of ``mean`` and ``cov``.

    Reduced-rank regression of the maps' own predictions: with ``W`` ``(hidden, D)`` the maps side
    by side (``D = 2 * kv_dim * len(projectors)``) and the inputs' covariance ``cov``, the rank-``r``
    map ``W_r`` minimising ``E||(h - mean) (W - W_r) / s||²`` is ``W_s V_r V_rᵀ s`` with ``W_s = W / s``
    and ``V_r`` the top ``r`` right singular vectors of ``cov^½ W_s``.  ``s`` scales each layer's K
    and V block by the RMS of its predictions, so that every block counts alike (unscaled, the
    layers with the largest values would take the basis).  The bias keeps the prediction at
    ``mean`` the maps' own.

    Parameters
    ----------
    projectors
        ``{layer: linear KVProjector}`` of one ``hidden_size``/``kv_dim``, in the bank's layer order.
    mean, cov
        ``(hidden,)`` and ``(hidden, hidden)``: the first two moments of the ``H_split`` the bank
        will read (:func:`ced_csa2.train.mode_a_training.input_moments`).
    rank
        The basis width, capped at ``min(hidden, D)``, where the bank reproduces the maps exactly.

    Returns
    -------
    ProjectorBank
        float32, on ``mean``'s device.
    """
    first = next(iter(projectors.values()))
    if any(p.mlp is not None for p in projectors.values()):
        raise ValueError("reduced_rank: a bank factors linear projectors; these have residual heads")
    W = torch.cat([p.proj.weight.double().T for p in projectors.values()], 1)  # (hidden, D)
    b = torch.cat([p.proj.bias.double() for p in projectors.values()])
    mean, cov = mean.double(), cov.double()
    # block RMS of the centred predictions: diag(Wᵀ cov W) averaged over each K or V block
    s = ((W * (cov @ W)).sum(0).clamp_min(0).view(-1, first.kv_dim).mean(1).sqrt().clamp_min(1e-12)
         .repeat_interleave(first.kv_dim))
    evals, evecs = torch.linalg.eigh(cov)
    root = evecs * evals.clamp_min(0).sqrt()  # cov = root rootᵀ
    W_s = W / s
    V = torch.linalg.svd(root.T @ W_s, full_matrices=False)[2][:rank].T  # (D, r), r = min(rank, hidden, D)
    bank = ProjectorBank(first.hidden_size, first.kv_dim, projectors, V.shape[1], device=mean.device)
    bank.basis.weight.copy_((W_s @ V).T)
    bank.heads.weight.copy_(V * s[:, None])
    bank.heads.bias.copy_(b + mean @ W - mean @ (W_s @ V) @ (V.T * s))
    return bank.float()


def save_bank(path: str | Path, bank: ProjectorBank, meta: Mapping) -> Path:
    """Write ``bank`` (FP16 weights) and ``meta`` (:func:`~ced_csa2.pipeline.checkpoint.checkpoint_meta`'s
    ``"bank"``) to ``path`` atomically; ``layers``, dims and ``rank`` are taken from the module."""
    form = {"layers": list(bank.layers), "hidden_size": bank.hidden_size, "kv_dim": bank.kv_dim, "rank": bank.rank}
    required = tuple(k for k in REQUIRED_META if k != "layer") + ("hidden_size", "kv_dim", "rank")
    return save_checkpoint(path, KIND_BANK, bank, {**meta, **form}, required)


def load_bank(path: str | Path, *, role: Role, expect: Mapping | None = None, device=None,
              dtype: torch.dtype | None = None) -> tuple[ProjectorBank, dict]:
    """Load a file of :func:`save_bank`: ``(bank, meta)``, checked as :func:`load_projector` checks its file."""
    state, meta = load_checkpoint(path, KIND_BANK, expect, role=role)
    bank = ProjectorBank(meta["hidden_size"], meta["kv_dim"], meta["layers"], meta["rank"], device="meta")
    bank.to_empty(device="cpu")
    load_state(Path(path), bank, state)
    return bank.to(device=device, dtype=dtype or torch.float32).eval(), meta
