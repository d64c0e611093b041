"""CSA2 cross-layer adapters: the source layer's K/V to each target layer's K/V.

For every target layer ``t`` there is one adapter for K and one for V, each

    y = base(x) + mlp(x),   base = Linear(n, d),   mlp = Linear(n, w) -> act -> Linear(w, d)

with ``d = kv_dim``, ``w = width_mult * kv_dim`` and input ``x`` either the source's
stored entry as a whole, ``[K_src ‖ V_src]`` (``input="kv"``, ``n = 2d``: the seed's
"adapters map KV_source to their own KV"), or only its own kind (``input="own"``, ``n = d``:
K from K, V from V).  Both read the same stored bytes.  The base starts at the
closed-form ridge solution and the MLP's last layer at zero, so a fresh adapter *is*
the ridge map (bit for bit: see :func:`ced_csa2.pipeline.checkpoint.init_linear_from_ridge`).
On Qwen3.5-4B (kv_dim 1024, w 1536) one target layer's K+V adapters hold 8,395,776
parameters with ``input="own"`` and 13,638,656 with ``input="kv"``.  The file
``models/adapters.pt`` holds FP16 weights and metadata.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping

import torch
from torch import nn

from .pipeline.checkpoint import init_linear_from_ridge, load_checkpoint, load_state, save_checkpoint
from .pipeline.map_roles import Role

KIND = "adapters"
ACTIVATIONS = {"gelu": nn.GELU, "silu": nn.SiLU, "relu": nn.ReLU}
# What an adapters file must say about itself besides its architecture (added by save_adapters):
# see ced_csa2.pipeline.checkpoint.expected_meta / checkpoint_meta.
REQUIRED_META = ("role", "source", "split", "plan", "model", "model_id", "hidden_size", "params_hash")
INPUTS = ("kv", "own")  # what each adapter reads of the source's entry: all of it, or its own kind


def input_dim(kv_dim: int, input: str) -> int:
    """Width of an adapter's input: ``2 kv_dim`` for ``[K ‖ V]``, ``kv_dim`` for its own kind."""
    if input not in INPUTS:
        raise ValueError(f"unknown adapter input {input!r}; choose one of {list(INPUTS)}")
    return 2 * kv_dim if input == "kv" else kv_dim


def mlp_width(kv_dim: int, width_mult: float) -> int:
    """Hidden width of the residual MLP: ``round(width_mult * kv_dim)`` (1536 for 1.5 x 1024)."""
    return int(round(width_mult * kv_dim))


class ResidualMLP(nn.Module):
    """``Linear(n -> w) -> act -> Linear(w -> d)``; the last layer starts at zero (output exactly 0)."""

    def __init__(self, dim: int, width: int, activation: str = "gelu", *, in_dim: int | None = None, device=None,
                 dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {sorted(ACTIVATIONS)}")
        self.up = nn.Linear(in_dim or dim, width, device=device, dtype=dtype)
        self.act = ACTIVATIONS[activation]()
        self.down = nn.Linear(width, dim, device=device, dtype=dtype)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., n) -> (..., d)``."""
        return self.down(self.act(self.up(x)))


class KVAdapter(nn.Module):
    """One K (or V) map of one target layer: ``y = base(x) + mlp(x)``, ``(..., n) -> (..., d)``, ``n = in_dim or d``."""

    def __init__(self, dim: int, width: int, activation: str = "gelu", *, in_dim: int | None = None, device=None,
                 dtype=None):
        super().__init__()
        self.base = nn.Linear(in_dim or dim, dim, device=device, dtype=dtype)
        self.mlp = ResidualMLP(dim, width, activation, in_dim=in_dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.mlp(x)

    def init_from_ridge(self, W: torch.Tensor, b: torch.Tensor) -> None:
        """Copy the ridge solution (``W`` ``(n, d)`` in ``x @ W + b`` orientation, ``b`` ``(d,)``) into the base.

        With the MLP still at its zero start, ``self(x)`` then equals the ridge
        prediction ``F.linear(x, W.T.contiguous(), b)`` bit for bit (adding the MLP's
        exact zeros changes nothing).
        """
        init_linear_from_ridge(self.base, W, b)

    def param_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """``(base parameters, MLP parameters)``: the two SGD learning-rate groups."""
        return list(self.base.parameters()), list(self.mlp.parameters())


class CSA2Adapters(nn.Module):
    """K and V adapters of every target layer, keyed by ``str(layer)``.

    Parameters
    ----------
    layers
        Target layers (1-based).
    kv_dim
        K/V width (the source's and every target's).
    width
        MLP hidden width; default ``mlp_width(kv_dim, width_mult)``.
    width_mult, activation
        MLP shape when ``width`` is not given, and its nonlinearity.
    input
        What each adapter reads: ``"kv"`` -- the source's whole entry ``[K ‖ V]``;
        ``"own"`` -- its own kind only (K from K, V from V).
    """

    def __init__(self, layers: Iterable[int], kv_dim: int, *, width: int | None = None, width_mult: float = 1.5,
                 activation: str = "gelu", input: str = "kv", device=None, dtype=None):
        super().__init__()
        self.layers = tuple(int(t) for t in layers)
        self.kv_dim, self.activation, self.input = kv_dim, activation, input
        self.width = width or mlp_width(kv_dim, width_mult)
        n = input_dim(kv_dim, input)

        def make():
            return KVAdapter(kv_dim, self.width, activation, in_dim=n, device=device, dtype=dtype)

        self.k = nn.ModuleDict({str(t): make() for t in self.layers})
        self.v = nn.ModuleDict({str(t): make() for t in self.layers})

    def adapter(self, kind: str, layer: int) -> KVAdapter:
        """The ``"k"`` or ``"v"`` adapter of target ``layer``."""
        return {"k": self.k, "v": self.v}[kind][str(layer)]

    def forward(self, layer: int, k_src: torch.Tensor, v_src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of target ``layer`` from the source's ``(..., kv_dim)`` K and V."""
        key = str(layer)
        if key not in self.k:
            raise KeyError(f"no adapters for layer {layer}; this module adapts layers {list(self.layers)}")
        if self.input == "own":
            return self.k[key](k_src), self.v[key](v_src)
        kv = torch.cat([k_src, v_src], dim=-1)
        return self.k[key](kv), self.v[key](kv)


def save_adapters(path: str | Path, adapters: CSA2Adapters, meta: Mapping) -> Path:
    """Write ``adapters`` (FP16 weights) and ``meta`` to ``path`` atomically.

    ``meta`` must hold :data:`REQUIRED_META` (role, source, split, plan, model, model_id, the
    model's hidden_size, params_hash; :func:`ced_csa2.pipeline.checkpoint.checkpoint_meta` gives
    them); ``layers`` (targets), ``kv_dim``, ``width``, ``activation`` and ``input`` come
    from the module, so the file describes the weights it holds.
    """
    meta = {**meta, "layers": list(adapters.layers), "kv_dim": adapters.kv_dim, "width": adapters.width,
            "activation": adapters.activation, "input": adapters.input}
    return save_checkpoint(path, KIND, adapters, meta, REQUIRED_META)


def load_adapters(path: str | Path, device=None, dtype: torch.dtype | None = None, *, role: Role,
                  expect: Mapping | None = None, revision: str | None = None) -> CSA2Adapters:
    """Load an adapters file (the seed's API), or a release's adapters.

    Parameters
    ----------
    path
        A file written by :func:`save_adapters`; or a release folder or hub id (with ``revision``), whose main
        adapters are read after the release's own checks (:func:`ced_csa2.release.load_main_map`).
    device, dtype
        Where and in what dtype to build the module (default: CPU, float32 -- which
        holds the stored FP16 values exactly).
    role
        The branch (and, for an objective's, the pair) it must belong to
        (:mod:`ced_csa2.pipeline.map_roles`): another one is refused naming the file and both
        roles, before its tensors are read.
    expect
        Metadata the file must match, e.g. ``{"kv_dim": 1024, "layers": [24, 28, 32],
        "source": 20}`` (the pipeline passes ``expected_meta(...)["adapters"]``, see
        :func:`ced_csa2.pipeline.checkpoint.expected_meta`); a mismatch raises
        :class:`~ced_csa2.pipeline.checkpoint.CheckpointError` naming the file, key and both values,
        before any weight is read into a module.

    Returns
    -------
    CSA2Adapters
        In eval mode; the file's metadata is attached as ``.meta``.
    """
    from . import release  # the release reads this module's classes: imported when used

    if release.is_release(path, revision):
        return release.load_main_map(path, KIND, role=role, expect=expect, revision=revision, device=device,
                                     dtype=dtype)[0]
    state, meta = load_checkpoint(path, KIND, expect, role=role)
    adapters = CSA2Adapters(meta["layers"], meta["kv_dim"], width=meta["width"], activation=meta["activation"],
                            input=meta["input"], device="meta")
    adapters.to_empty(device="cpu")
    load_state(Path(path), adapters, state)
    adapters = adapters.to(device=device, dtype=dtype or torch.float32).eval()
    adapters.meta = meta
    return adapters
