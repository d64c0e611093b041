"""xKV: one cross-layer SVD basis for the K (and one for the V) of a CSA2 group's layers.

The training-free low-rank baseline CSA2 must beat at equal bytes (Chang et al. 2025,
"xKV: Cross-Layer SVD for KV-Cache Compression").  For the group of layers
``(source, *targets)`` (``L`` layers, each K/V row ``kv_dim`` wide, pre-k_norm and
pre-RoPE: the ``k_proj``/``v_proj`` outputs the dump holds) the K rows of one token are
stacked along channels, ``x = [k_source; k_t1; ...]`` of width ``D = L * kv_dim``, and

* **fit**: ``G = Σ x xᵀ`` over the training rows (float64, streamed block by block:
  :class:`GramAccumulator`), eigendecomposed; ``U_r`` = the eigenvectors of the ``r``
  largest eigenvalues, ``(D, r)``.  These are the top-``r`` right singular vectors of the
  row matrix ``X`` (``XᵀX = V S² Vᵀ``): the best rank-``r`` subspace in squared error.
  **Uncentred**, as xKV: no mean is subtracted (a mean would be one more stored vector,
  and K has large per-channel offsets the basis then spends a direction on);
* **compress**: per token the ``r`` coefficients ``c = U_rᵀ x`` -- the only per-token
  entry stored (``r = kv_dim``, the default, is exactly the bytes of CSA2's one shared
  ``kv_dim`` entry);
* **reconstruct**: ``x̂ = U_r c``; each layer of the group reads its ``kv_dim`` block.

The same for V with its own basis.  The bases are weights: ``2 * D * r`` parameters.
``models/xkv.pt`` is a :mod:`ced_csa2.pipeline.checkpoint` file (FP16 bases, metadata checked on
load like every other map file).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from ..pipeline.checkpoint import load_checkpoint, load_state, save_checkpoint
from ..pipeline.map_roles import Role

KIND = "xkv"
KINDS = ("k", "v")
# What an xkv file must say about itself besides its shape (layers, kv_dim, rank come from
# the module): see ced_csa2.pipeline.checkpoint.expected_meta / checkpoint_meta.
REQUIRED_META = ("role", "model", "model_id", "hidden_size", "plan", "split", "params_hash")

KV = tuple[torch.Tensor, torch.Tensor]


def group_layers(plan) -> tuple[int, ...]:
    """The layers one basis spans, in stacking order: ``(source, *targets)``."""
    return (plan.source, *plan.targets)


# ----------------------------------------------------------------------------- fit

class GramAccumulator:
    """``G = Σ x xᵀ`` of rows streamed in blocks, in float64 (uncentred).

    Parameters
    ----------
    dim
        Row width ``D`` (``L * kv_dim``).
    name
        Names the accumulator in error messages.

    Attributes
    ----------
    gram : torch.Tensor, shape (D, D), float64
    n : int
        Rows added.
    """

    def __init__(self, dim: int, name: str = "xkv"):
        self.dim, self.name, self.n = dim, name, 0
        self.gram = torch.zeros(dim, dim, dtype=torch.float64)

    def update(self, X: torch.Tensor) -> None:
        """Add rows ``X`` ``(n, D)`` (any float dtype; accumulated in float64)."""
        if X.ndim != 2 or X.shape[1] != self.dim:
            raise ValueError(f"{self.name}: update needs rows (n, {self.dim}), got {tuple(X.shape)}")
        Xd = X.detach().to("cpu", torch.float64)
        self.gram.addmm_(Xd.T, Xd)
        self.n += X.shape[0]


def top_eigenvectors(gram: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``rank`` leading eigenvectors of a Gram matrix and its whole spectrum.

    Parameters
    ----------
    gram : torch.Tensor, shape (D, D)
        Symmetric positive semi-definite (float64 recommended).
    rank
        ``1 <= rank <= D``.

    Returns
    -------
    U : torch.Tensor, shape (D, rank), float64
        Orthonormal columns, eigenvalues descending; each column's sign fixed so that its
        largest-magnitude entry is positive (eigh's signs are arbitrary; this makes the
        file reproducible bit for bit across runs on the same data).
    eigenvalues : torch.Tensor, shape (D,), float64
        Descending (tiny negative round-off clipped to 0).
    """
    D = gram.shape[0]
    if not 1 <= rank <= D:
        raise ValueError(f"rank must be in [1, {D}], got {rank}")
    G = gram.to(torch.float64)
    evals, Q = torch.linalg.eigh((G + G.T) / 2)  # addmm rounding leaves G a hair off symmetric
    evals, Q = evals.flip(0).clamp_min(0), Q.flip(1)
    U = Q[:, :rank]
    pivot = U.abs().argmax(0)
    U = U * torch.sign(U[pivot, torch.arange(rank)])
    return U.contiguous(), evals


# ----------------------------------------------------------------------------- the bases

class XKVBasis(nn.Module):
    """The K and V bases of one group: compress its layers' K/V into ``rank`` coefficients and back.

    Parameters
    ----------
    layers
        The group's layers in stacking order, ``(source, *targets)``.
    kv_dim
        Width of one layer's K (or V) row.
    rank
        Coefficients per token for K, and as many for V.

    Attributes
    ----------
    k, v : torch.Tensor, shape (len(layers) * kv_dim, rank)
        Orthonormal bases (buffers: fitted in closed form, never trained).
    """

    def __init__(self, layers: Sequence[int], kv_dim: int, rank: int, *, device=None, dtype=None):
        super().__init__()
        self.layers, self.kv_dim, self.rank = tuple(int(l) for l in layers), int(kv_dim), int(rank)
        width = len(self.layers) * self.kv_dim
        if not 1 <= self.rank <= width:
            raise ValueError(f"xkv rank must be in [1, {width}] (layers {list(self.layers)} x kv_dim {kv_dim}), "
                             f"got {rank}")
        for kind in KINDS:
            self.register_buffer(kind, torch.zeros(width, self.rank, device=device, dtype=dtype))

    @classmethod
    def from_grams(cls, grams: Mapping[str, torch.Tensor], layers: Sequence[int], kv_dim: int, rank: int, *,
                   dtype=torch.float32) -> XKVBasis:
        """The bases of the top-``rank`` eigenvectors of ``grams["k"]`` and ``grams["v"]`` ``(D, D)``."""
        basis = cls(layers, kv_dim, rank, dtype=dtype)
        with torch.no_grad():
            for kind in KINDS:
                getattr(basis, kind).copy_(top_eigenvectors(grams[kind], rank)[0])
        return basis

    def stack(self, rows: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """``[x_source; x_t1; ...]`` ``(..., L * kv_dim)`` from ``{layer: (..., kv_dim)}``."""
        return torch.cat([rows[layer] for layer in self.layers], dim=-1)

    def compress(self, kind: str, rows: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """The stored entry: ``c = U_rᵀ x``, ``(..., rank)``, in the basis' dtype."""
        U = getattr(self, kind)
        return self.stack(rows).to(U.dtype) @ U

    def reconstruct(self, kind: str, coefficients: torch.Tensor) -> dict[int, torch.Tensor]:
        """``{layer: (..., kv_dim)}``: each layer's block of ``U_r c``, in the basis' dtype."""
        U = getattr(self, kind)
        blocks = (coefficients.to(U.dtype) @ U.T).split(self.kv_dim, dim=-1)
        return dict(zip(self.layers, blocks))

    def forward(self, k: Mapping[int, torch.Tensor], v: Mapping[int, torch.Tensor]) -> dict[int, KV]:
        """What every layer of the group reads back: ``{layer: (k̂, v̂)}``, each ``(..., kv_dim)``.

        Computed in the basis' dtype; the coefficients are rounded to the inputs' dtype on
        the way (what a cache in the model's dtype would hold), and the result is returned
        in it.  With an fp32 model and fp32 bases every cast is a no-op.
        """
        dtype = k[self.layers[0]].dtype
        out = {}
        for kind, rows in (("k", k), ("v", v)):
            stored = self.compress(kind, rows).to(dtype)
            out[kind] = {layer: x.to(dtype) for layer, x in self.reconstruct(kind, stored).items()}
        return {layer: (out["k"][layer], out["v"][layer]) for layer in self.layers}


# ----------------------------------------------------------------------------- checkpoint

def save_xkv(path: str | Path, basis: XKVBasis, meta: Mapping) -> Path:
    """Write ``basis`` (FP16) and ``meta`` to ``path`` atomically.

    ``meta`` must hold :data:`REQUIRED_META` (:func:`ced_csa2.pipeline.checkpoint.checkpoint_meta`
    gives them); ``layers``, ``kv_dim`` and ``rank`` come from the module, so the file
    describes the weights it holds.
    """
    meta = {**meta, "layers": list(basis.layers), "kv_dim": basis.kv_dim, "rank": basis.rank}
    return save_checkpoint(path, KIND, basis, meta, REQUIRED_META)


def load_xkv(path: str | Path, device=None, dtype: torch.dtype | None = None, *, role: Role,
             expect: Mapping | None = None) -> XKVBasis:
    """Load an xkv file written by :func:`save_xkv`.

    Parameters
    ----------
    path
        The file.
    device, dtype
        Where and in what dtype to build the module (default: CPU, float32).
    role
        The branch it must belong to (:mod:`ced_csa2.pipeline.map_roles`; the pipeline's is ``main``).
    expect
        Metadata the file must match (the pipeline passes ``expected_meta(...)["xkv"]``:
        model, layers, hidden_size, kv_dim, plan); a mismatch raises
        :class:`~ced_csa2.pipeline.checkpoint.CheckpointError` naming the file, the key and both
        values, before any weight is read into a module.

    Returns
    -------
    XKVBasis
        In eval mode, the file's metadata attached as ``.meta``.
    """
    state, meta = load_checkpoint(path, KIND, expect, role=role)
    basis = XKVBasis(meta["layers"], meta["kv_dim"], meta["rank"])
    load_state(Path(path), basis, state)
    basis = basis.to(device=device, dtype=dtype or torch.float32).eval()
    basis.meta = meta
    return basis
