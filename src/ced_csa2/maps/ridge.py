"""Closed-form ridge maps between dumped activations (streaming, float64 statistics).

The ``ridge`` stage (:mod:`ced_csa2.stages.ridge`) splits the dump's records into train
and validation (:func:`ced_csa2.data.loader.record_split`, the split both trainers use),
streams the training rows once and fits, with ``λ = ridge.lambda`` and an unpenalised bias:

* ``proj_{l}`` for each projected layer ``l``: ``h_split → [k_l ‖ v_l]``, the linear
  baseline of the CED projector;
* the bases of the CSA2 adapters, for each target ``t`` (separate K and V maps, as the
  adapters have): ``k_{t}``: ``k_{source} → k_t`` and ``v_{t}``: ``v_{source} → v_t``
  (``train_adapters.input: own``), and ``k_{t}_from_kv`` / ``v_{t}_from_kv`` from the
  whole stored entry ``[k_{source} ‖ v_{source}]`` (``input: kv``);
* ``ced_`` + each of those, fitted from the *projected* source K/V (``proj_{source}``
  applied to ``h_split``) in a second pass once ``proj_{source}`` is solved -- the adapters
  the ``ced_csa2`` group reads with (its targets never see the true source K/V).

A second streaming pass over the validation records measures each map with
:class:`~ced_csa2.maps.fit_metrics.FitStats` (``proj_{l}`` also per K and V half, as
``proj_{l}_k`` and ``proj_{l}_v``).  Outputs: ``models/ridge.pt``
(``{"format_version": 2, "maps": {name: {"W": (d_in, d_out) float32, "b": (d_out,) float32}},
"sha256": ..., "meta": ...}``;
a map is applied as ``y = x @ W + b``) and ``metrics/ridge.json``.

Memory is O(d²) per input dataset whatever the number of rows: ``XᵀX``, ``XᵀY`` and
the sums are accumulated in float64 (:class:`RidgeAccumulator`), and maps that share an
input share one Gram matrix, since ridge with one ``X`` and one ``λ`` solves each
output column independently.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from ..config import check_provenance
from ..data.dump_file import DumpReader
from ..data.loader import active_blocks, cat_features, iter_blocks
from ..pipeline import distributed
from ..pipeline.atomic_files import atomic_write_bytes
from ..pipeline.checkpoint import CheckpointError, other_version_error, state_digest
from ..pipeline.progress import Progress
from ..plan import LayerPlan
from .fit_metrics import FitStats, merged

log = logging.getLogger(__name__)

# Above this condition number a float64 Cholesky solve loses more digits than float32
# weights keep; treat the system as singular and take the pseudo-inverse instead.
MAX_COND = 1e12
DUMP_ATTRS = ("model", "model_id", "tokenizer_sha256", "params_hash", "fingerprint")


# ----------------------------------------------------------------------------- streaming ridge

class RidgeAccumulator:
    """Sufficient statistics of a ridge regression, accumulated batch by batch.

    Keeps ``Σ (x-s)(x-s)ᵀ (d_in, d_in)``, ``Σ (x-s)(y-t)ᵀ (d_in, d_out)``, ``Σ (x-s)``,
    ``Σ (y-t)`` and ``n`` in float64, where ``s``, ``t`` are the means of the first
    batch: the provisional shift keeps the later centring from cancelling a large
    common offset (activations have channels with means far above their spread).

    Parameters
    ----------
    d_in, d_out
        Feature widths of ``X`` and ``Y``.
    name
        Names the regression in log messages.
    """

    def __init__(self, d_in: int, d_out: int, name: str = "ridge"):
        self.d_in, self.d_out, self.name = d_in, d_out, name
        self.n = 0
        self._shift_x = self._shift_y = None
        self._xtx = torch.zeros(d_in, d_in, dtype=torch.float64)
        self._xty = torch.zeros(d_in, d_out, dtype=torch.float64)
        self._sx = torch.zeros(d_in, dtype=torch.float64)
        self._sy = torch.zeros(d_out, dtype=torch.float64)

    def update(self, X: torch.Tensor, Y: torch.Tensor) -> None:
        """Add rows ``X (n, d_in)`` with targets ``Y (n, d_out)`` (any float dtype)."""
        if X.ndim != 2 or Y.ndim != 2 or X.shape[1] != self.d_in or Y.shape[1] != self.d_out \
                or X.shape[0] != Y.shape[0]:
            raise ValueError(f"ridge {self.name}: update needs X (n, {self.d_in}) and Y (n, {self.d_out}), got "
                             f"{tuple(X.shape)} and {tuple(Y.shape)}")
        if X.shape[0] == 0:
            return
        # Always a fresh float64 copy, so shifting it in place never touches the caller's tensor.
        Xs = X.detach().to("cpu", torch.float64, copy=True)
        Ys = Y.detach().to("cpu", torch.float64, copy=True)
        if self._shift_x is None:
            self.set_shift(Xs, Ys)
        Xs -= self._shift_x
        Ys -= self._shift_y
        self._xtx.addmm_(Xs.T, Xs)
        self._xty.addmm_(Xs.T, Ys)
        self._sx += Xs.sum(0)
        self._sy += Ys.sum(0)
        self.n += X.shape[0]

    def set_shift(self, X: torch.Tensor, Y: torch.Tensor) -> None:
        """Centre on the means of ``X (n, d_in)`` and ``Y (n, d_out)`` (by default the first batch's)."""
        self._shift_x = X.detach().to("cpu", torch.float64).mean(0)
        self._shift_y = Y.detach().to("cpu", torch.float64).mean(0)

    def all_reduce(self) -> None:
        """Sum every rank's statistics; the ranks must share one shift (:meth:`set_shift`)."""
        n = torch.tensor([float(self.n)], dtype=torch.float64)  # exact below 2**53 rows
        distributed.all_reduce_sum(self._xtx, self._xty, self._sx, self._sy, n)
        self.n = int(n.item())

    def solve(self, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Ridge solution with an unpenalised bias, in float64.

        ``W = (XcᵀXc + λI)⁻¹ XcᵀYc`` on the centred data, ``b = ȳ - x̄ W``, so that
        ``x @ W + b`` predicts ``y`` -- what ``sklearn.linear_model.Ridge(alpha=λ,
        fit_intercept=True)`` computes.  Cholesky solve; when ``XcᵀXc + λI`` is not
        safely positive definite (a failed factorisation, or a condition number above
        :data:`MAX_COND`) it logs a warning saying so and returns the minimum-norm
        solution through an eigendecomposition pseudo-inverse.

        Returns
        -------
        W : (d_in, d_out) float64
        b : (d_out,) float64
        """
        if self.n == 0:
            raise ValueError(f"ridge {self.name}: solve called before any rows were added")
        mx, my = self._sx / self.n, self._sy / self.n
        A = self._xtx - self.n * torch.outer(mx, mx)
        A = (A + A.T) / 2  # gemm rounding leaves XᵀX a hair off symmetric
        A.diagonal().add_(lam)
        B = self._xty - self.n * torch.outer(mx, my)
        W = _spd_solve(A, B, f"ridge {self.name} (lambda={lam:g}, n={self.n})")
        b = (my + self._shift_y) - (mx + self._shift_x) @ W
        return W, b


def _spd_solve(A: torch.Tensor, B: torch.Tensor, what: str) -> torch.Tensor:
    """Solve ``A W = B`` for symmetric ``A (d, d)``, ``B (d, k)``: Cholesky, else a pseudo-inverse."""
    L, info = torch.linalg.cholesky_ex(A)
    if int(info) == 0:
        diag = L.diagonal()
        # (max L_ii / min L_ii)² is a lower bound on cond(A) that comes free with L.
        cond = float((diag.max() / diag.min()) ** 2)
        if cond <= MAX_COND:
            return torch.cholesky_solve(B, L)
        reason = f"its condition number is at least {cond:.1e} (limit {MAX_COND:.0e})"
    else:
        reason = f"the Cholesky factorisation failed at leading minor {int(info)}"
    evals, Q = torch.linalg.eigh(A)
    tol = float(evals.abs().max()) * A.shape[0] * torch.finfo(A.dtype).eps
    keep = evals > tol
    log.warning("%s: XcᵀXc + λI is singular or too ill-conditioned for a Cholesky solve (%s; collinear inputs "
                "with a small lambda?); falling back to the minimum-norm eigh pseudo-inverse, rank %d of %d",
                what, reason, int(keep.sum()), A.shape[0])
    inv = torch.where(keep, 1.0 / evals, torch.zeros_like(evals))
    return Q @ (inv[:, None] * (Q.T @ B))


# ----------------------------------------------------------------------------- the maps of a plan

@dataclass(frozen=True)
class MapGroup:
    """Maps that share one input dataset (and so one Gram matrix).

    ``maps[name]`` lists the datasets concatenated into that map's output.
    """

    x: str | tuple[str, ...]  # one dataset, or several concatenated along features
    maps: dict[str, tuple[str, ...]]

    @property
    def xs(self) -> tuple[str, ...]:
        return (self.x,) if isinstance(self.x, str) else self.x

    @property
    def y(self) -> list[str]:
        return [n for ys in self.maps.values() for n in ys]


def adapter_map(kind: str, target: int, input: str, projected: bool = False) -> str:
    """Name of the ridge map a target's ``kind`` adapter starts from.

    ``input``: ``"own"`` (from the source's ``kind``) or ``"kv"`` (from ``[K ‖ V]``, suffix
    ``_from_kv``); ``projected``: fitted on the projected source (prefix ``ced_``).
    """
    return f"{'ced_' if projected else ''}{kind}_{target}{'_from_kv' if input == 'kv' else ''}"


def _adapter_groups(plan: LayerPlan, k_src: str, v_src: str, projected: bool) -> list[MapGroup]:
    """The adapters' maps from source inputs ``k_src``/``v_src``: from each kind alone and from both."""
    kinds = {"k": k_src, "v": v_src}
    return [*(MapGroup(x, {adapter_map(kind, t, "own", projected): (f"{kind}_{t}",) for t in plan.targets})
              for kind, x in kinds.items()),
            MapGroup((k_src, v_src), {adapter_map(kind, t, "kv", projected): (f"{kind}_{t}",)
                                      for t in plan.targets for kind in kinds})]


def map_groups(plan: LayerPlan) -> list[MapGroup]:
    """The ridge maps of a plan, grouped by input: projector baselines, then the adapters' bases."""
    return [MapGroup("h_split", {f"proj_{layer}": (f"k_{layer}", f"v_{layer}") for layer in plan.projected}),
            *_adapter_groups(plan, f"k_{plan.source}", f"v_{plan.source}", projected=False)]


@dataclass(frozen=True)
class Derive:
    """Inputs computed from each block: ``fn(block)`` adds ``widths``' names, reading ``needs``."""

    widths: dict[str, int]
    needs: tuple[str, ...]
    fn: Callable[[dict[str, np.ndarray]], None]


def projected_groups(plan: LayerPlan, proj: dict[str, torch.Tensor]) -> tuple[list[MapGroup], Derive]:
    """The adapter maps of ``ced_csa2``: from the source K/V that ``proj`` (``proj_{source}``) predicts.

    Returns the map groups (inputs ``ced_k_{s}``, ``ced_v_{s}``, the projector's K and V
    halves; outputs the targets' true K/V) and what adds those inputs to a block read from
    the dump.
    """
    s = plan.source
    k_in, v_in = f"ced_k_{s}", f"ced_v_{s}"

    def derive(block: dict[str, np.ndarray]) -> None:
        kv = torch.from_numpy(block["h_split"]) @ proj["W"] + proj["b"]
        block[k_in], block[v_in] = (x.numpy() for x in kv.chunk(2, dim=1))

    width = proj["W"].shape[1] // 2
    return _adapter_groups(plan, k_in, v_in, projected=True), Derive({k_in: width, v_in: width}, ("h_split",), derive)


def _blocks(reader: DumpReader, groups: list[MapGroup], mask: np.ndarray, block_rows: int,
            derive: Derive | None, blocks: np.ndarray | None = None) -> Iterator[dict[str, np.ndarray]]:
    """The masked rows of every dataset ``groups`` read, block by block, with the derived inputs added.

    ``blocks``: which ``block_rows``-row blocks (default: this rank's share of the active ones).
    """
    made = derive.widths if derive else {}
    names = [n for g in groups for n in [*g.xs, *g.y] if n not in made] + list(derive.needs if derive else ())
    if blocks is None:
        blocks = distributed.shard(active_blocks(mask, block_rows))
    for block in iter_blocks(reader, list(dict.fromkeys(names)), mask, block_rows, blocks):
        if derive:
            derive.fn(block)
        yield block


def accumulate(reader: DumpReader, groups: list[MapGroup], mask: np.ndarray, block_rows: int,
               derive: Derive | None = None) -> list[RidgeAccumulator]:
    """The statistics of every group's regression over the masked rows, one pass over the file.

    Under a process group each rank accumulates its share of the blocks and the float64
    statistics are summed across ranks (:meth:`RidgeAccumulator.all_reduce`), so every rank
    holds the totals.
    """
    widths = {**reader.layout.widths(), **(derive.widths if derive else {})}
    accs = [RidgeAccumulator(sum(widths[n] for n in g.xs), sum(widths[n] for n in g.y),
                             name=f"{' ‖ '.join(g.xs)} -> {', '.join(g.maps)}") for g in groups]
    first = active_blocks(mask, block_rows)[:1]
    if distributed.world_size() > 1 and len(first):
        # Every rank centres on the first block of the whole mask, as one process does: the ranks'
        # sums then add up to the single-process ones.
        block = next(_blocks(reader, groups, mask, block_rows, derive, first))
        for g, acc in zip(groups, accs):
            acc.set_shift(torch.from_numpy(cat_features(block, g.xs)), torch.from_numpy(cat_features(block, g.y)))
    with Progress(total=int(mask.sum()), desc="ridge fit", unit="row", unit_scale=True,
              disable=not distributed.is_main()) as bar:
        for block in _blocks(reader, groups, mask, block_rows, derive):
            for g, acc in zip(groups, accs):
                acc.update(torch.from_numpy(cat_features(block, g.xs)), torch.from_numpy(cat_features(block, g.y)))
            bar.update(len(block[groups[0].xs[0]]))
    for acc in accs:
        acc.all_reduce()
    return accs


def fit_maps(reader: DumpReader, groups: list[MapGroup], mask: np.ndarray, block_rows: int,
             lam: float, derive: Derive | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Fit every map on the masked rows (``derive``: computed inputs; :func:`accumulate`).

    Returns
    -------
    dict
        ``{name: {"W": (d_in, d_out) float32, "b": (d_out,) float32}}``.
    """
    widths = {**reader.layout.widths(), **(derive.widths if derive else {})}
    maps = {}
    for g, acc in zip(groups, accumulate(reader, groups, mask, block_rows, derive)):
        W, b = acc.solve(lam)
        col = 0
        for name, ys in g.maps.items():
            width = sum(widths[n] for n in ys)
            maps[name] = {"W": W[:, col:col + width].float().contiguous(), "b": b[col:col + width].float()}
            col += width
    return maps


def evaluate_maps(reader: DumpReader, groups: list[MapGroup], maps: dict, mask: np.ndarray,
                  block_rows: int, derive: Derive | None = None) -> dict[str, dict]:
    """Held-out fit of the stored (float32) maps on the masked rows, in one pass (``derive``: as :func:`fit_maps`).

    Under a process group each rank measures its share of the blocks and the ranks' statistics
    are merged in rank order (:meth:`~ced_csa2.maps.fit_metrics.FitStats.merge`).

    Returns
    -------
    dict
        ``{name: {"r2", "cos", "rel_mse", "mse", "n_val"}}``; a map with several output
        datasets also gets one entry per dataset, ``{name}_{k|v}``.
    """
    stats: dict[str, FitStats] = {}
    with Progress(total=int(mask.sum()), desc="ridge val", unit="row", unit_scale=True,
              disable=not distributed.is_main()) as bar:
        for block in _blocks(reader, groups, mask, block_rows, derive):
            for g in groups:
                X = torch.from_numpy(cat_features(block, g.xs))
                for name, ys in g.maps.items():
                    P = X @ maps[name]["W"] + maps[name]["b"]
                    Y = torch.from_numpy(cat_features(block, ys))
                    stats.setdefault(name, FitStats()).update(P, Y)
                    if len(ys) > 1:
                        col = 0
                        for y in ys:
                            width = block[y].shape[1]
                            part = f"{name}_{y.split('_')[0]}"
                            stats.setdefault(part, FitStats()).update(P[:, col:col + width], Y[:, col:col + width])
                            col += width
            bar.update(len(block[groups[0].xs[0]]))
    stats = merged(distributed.gather(stats))
    out = {}
    for name, s in stats.items():
        r = s.result()
        out[name] = {"r2": r["r2"], "cos": r["cos"], "rel_mse": r["rel_mse"], "mse": r["mse"], "n_val": r["n"]}
    return out


# ----------------------------------------------------------------------------- checkpoint

# 2: records its format_version; a file without one is of format 1 (whatever else it records).
RIDGE_FORMAT_VERSION = 2


def _flat(maps: dict) -> dict[str, torch.Tensor]:
    return {f"{name}.{part}": t for name, m in maps.items() for part, t in m.items()}


def save_ridge(path: Path, maps: dict, meta: dict) -> None:
    """Write ``{"format_version": 2, "maps": maps, "sha256": ..., "meta": meta}`` to ``path`` atomically.

    ``sha256`` is that of the maps' tensors (:func:`ced_csa2.pipeline.checkpoint.state_digest`).
    """
    buf = io.BytesIO()
    torch.save({"format_version": RIDGE_FORMAT_VERSION, "maps": maps, "sha256": state_digest(_flat(maps)),
                "meta": meta}, buf)
    atomic_write_bytes(Path(path), buf.getvalue())


def ridge_provenance(path: str | Path) -> dict:
    """The params the ridge maps were made from, the dump's included: what an artifact fitted from them records."""
    return load_ridge(path)[1].get("provenance") or {}


def load_ridge(path: str | Path, params=None) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """``(maps, meta)`` of a ridge checkpoint; ``maps[name] = {"W": (d_in, d_out), "b": (d_out,)}``.

    Refused, naming the file: missing, unreadable, not a ridge checkpoint, of another format version
    (:data:`RIDGE_FORMAT_VERSION`; a file without one is of format 1), tensors that are not
    the bytes it was written with (sha256), and -- with ``params`` -- made with other params
    (its recorded provenance, :func:`ced_csa2.config.check_provenance`).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: ridge checkpoint not found (run `dvc repro ridge`)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises many types (zip, pickle, EOF) for one cause: a bad file
        raise CheckpointError(f"{path}: not a readable ridge checkpoint (truncated or corrupt?): "
                              f"{type(exc).__name__}: {exc}") from None
    if not isinstance(ckpt, dict) or "maps" not in ckpt or "meta" not in ckpt:
        raise CheckpointError(f"{path}: not a ridge checkpoint (expected keys 'maps' and 'meta')")
    version = ckpt.get("format_version", 1)
    if version != RIDGE_FORMAT_VERSION:
        raise other_version_error(path, version, RIDGE_FORMAT_VERSION, "ridge")
    if state_digest(_flat(ckpt["maps"])) != ckpt.get("sha256"):
        raise CheckpointError(f"{path}: its tensors are not the bytes it was written with (sha256): the file "
                              "changed after it was written (rebuild it with `dvc repro ridge`)")
    if params is not None:
        check_provenance(path, ckpt["meta"].get("provenance") or {}, params)
    return ckpt["maps"], ckpt["meta"]
