"""What the two trainers (``train_projector``, ``train_adapters``) share.

* :func:`split_masks` -- validate the dump against the plan, then the train/val row
  masks (records split as the ridge stage splits them).
* :func:`ridge_maps` -- the closed-form maps that initialise either kind of map.
* :class:`TensorBatches` -- in-memory rows with :class:`~ced_csa2.data.loader.BlockLoader`'s
  interface, so one loop serves data streamed from disk and data held in memory.
* :class:`Head` and :func:`fit` -- one loop that trains several independent maps on the
  same batches (one read of the data for all of them), with per-epoch validation.
* :func:`evaluate`, :func:`write_curves` -- fp32 held-out metrics through
  :class:`~ced_csa2.maps.fit_metrics.FitStats`, and training curves, one series per TSV file.

The maps are independent (each loss touches only its own parameters), so summing their
losses and stepping one optimizer is exactly per-map training: AdamW and SGD update
each parameter from its own gradient alone.

Data-parallel (under :func:`ced_csa2.pipeline.distributed.session`): every rank draws the same
global batches (their order a function of the seed alone) and trains on its contiguous
slice of each; the heads are wrapped in ``DistributedDataParallel`` and each rank's loss
is weighted by its share of the batch, so DDP's gradient average is the gradient of the
global batch's loss -- one process's step at the same batch size, to float rounding.
Validation slices the batches the same way and merges the ranks' statistics.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Iterator, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..config import Params, check_provenance
from ..csa2 import CSA2Adapters
from ..data.dump_file import DumpError, DumpReader
from ..data.loader import record_split, row_mask
from ..maps.fit_metrics import FitStats, merged
from ..maps.ridge import adapter_map, load_ridge
from ..model_utils import Geometry, resolve_dtype
from ..pipeline import distributed
from ..pipeline.atomic_files import atomic_write_text
from ..pipeline.progress import Progress
from ..plan import LayerPlan

log = logging.getLogger(__name__)

_SHUFFLE_STREAM = 4  # numpy seed-sequence tag of TensorBatches (loader.py uses 0-3)


# ----------------------------------------------------------------------------- data

def split_masks(path: Path, params: Params, plan: LayerPlan, geo: Geometry, layers: Iterable[int],
                tokens_per_record: int) -> tuple[np.ndarray, np.ndarray]:
    """Check that the dump holds what the plan needs, then the train and val row masks.

    Parameters
    ----------
    path
        The dump file.
    params, plan, geo
        Validated parameters, layer plan and model geometry.
    layers
        Layers whose K/V the stage reads.
    tokens_per_record
        Rows drawn per record (0 = every token), as :func:`ced_csa2.data.loader.row_mask`.

    Returns
    -------
    train_mask, val_mask
        ``(N,)`` bool over the dump's rows; whole records on one side only.
    """
    with DumpReader(path) as reader:
        reader.check(kv_layers=list(layers), hidden_size=geo.hidden_size, kv_dim=geo.kv_dim)
        if int(reader.attrs.get("split", plan.split)) != plan.split:
            raise DumpError(f"{path}: holds H_{reader.attrs['split']}, the plan splits at layer {plan.split}")
        if reader.attrs.get("model", params.model.name) != params.model.name:
            raise DumpError(f"{path}: made with model {reader.attrs['model']!r}, params.model.name is "
                            f"{params.model.name!r}")
        check_provenance(path, reader.provenance(), params)
        offsets = reader.record_offsets
    train, val = record_split(len(offsets) - 1, params.split.val_fraction, params.seed)
    return (row_mask(offsets, train, tokens_per_record, params.seed),
            row_mask(offsets, val, tokens_per_record, params.seed))


def ridge_maps(path: Path, names: list[str], params: Params) -> dict[str, dict[str, torch.Tensor]]:
    """The named maps of the ridge stage's file, ``{name: {"W": (d_in, d_out), "b": (d_out,)}}`` float32.

    The file is refused unless it was made with ``params`` (:func:`ced_csa2.maps.ridge.load_ridge`).
    """
    maps, _ = load_ridge(path, params)
    missing = [n for n in names if n not in maps]
    if missing:
        raise ValueError(f"{path}: has no ridge maps {missing} (it holds {sorted(maps)}); rerun `dvc repro ridge`")
    return {n: {"W": maps[n]["W"].float(), "b": maps[n]["b"].float()} for n in names}


class Batches(Protocol):
    """What :func:`fit` iterates: ``(X, Y)`` float batches, re-shuffled per :meth:`set_epoch`."""

    n_rows: int

    def set_epoch(self, epoch: int) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...


class TensorBatches:
    """``(X, Y)`` batches of rows held in memory (the in-memory twin of ``BlockLoader``).

    Parameters
    ----------
    X, Y
        ``(n, d_x)`` and ``(n, d_y)`` tensors (rows paired).
    batch_size
        Rows per batch; the last batch of an epoch may be smaller.
    shuffle, seed
        Permute rows each epoch, seeded by ``(seed, epoch)``.
    """

    def __init__(self, X: torch.Tensor, Y: torch.Tensor, batch_size: int, *, shuffle: bool, seed: int):
        if X.shape[0] != Y.shape[0]:
            raise ValueError(f"TensorBatches needs paired rows, got {X.shape[0]} and {Y.shape[0]}")
        self.X, self.Y, self.batch_size, self.shuffle, self.seed = X, Y, batch_size, shuffle, seed
        self.epoch = 0

    @property
    def n_rows(self) -> int:
        return self.X.shape[0]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return math.ceil(self.n_rows / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        bs = self.batch_size
        if not self.shuffle:
            for s in range(0, self.n_rows, bs):
                yield self.X[s:s + bs], self.Y[s:s + bs]
            return
        rng = np.random.default_rng([self.seed, _SHUFFLE_STREAM, self.epoch])
        perm = torch.from_numpy(rng.permutation(self.n_rows))
        for s in range(0, self.n_rows, bs):
            idx = perm[s:s + bs]
            yield self.X[idx], self.Y[idx]


# ----------------------------------------------------------------------------- training loop

@dataclass
class Head:
    """One map trained by :func:`fit`: ``module(X[:, x]) ≈ Y[:, y]``.

    Attributes
    ----------
    label
        Names the head, e.g. ``{"layer": 20}`` or ``{"layer": 24, "kind": "k"}``; its curves are
        ``<curve_name(label)>_<metric>`` (``layer20_val_cos``, ``layer24_k_val_cos``).
    module
        ``(b, d_in) -> (b, d_out)``.
    x, y
        Column slices of the batch's ``X`` and ``Y``.
    parts
        Named column slices of its output, each measured on its own (``{"k": ..., "v": ...}``
        for a projector's ``K ‖ V``, ``{"k": slice(None)}`` for a K adapter).  The parts
        have equal widths, so the mean of their MSEs is the MSE of the whole output.
    """

    label: dict
    module: nn.Module
    x: slice
    y: slice
    parts: dict[str, slice]


def compute_dtype_name(device: torch.device, amp_dtype: str) -> str:
    """The dtype a trainer's matmuls run in on ``device`` under ``amp_dtype`` (``auto`` resolved): the protocol's word."""
    return str(resolve_dtype(amp_dtype, device)).removeprefix("torch.")


def amp_context(device: torch.device, amp_dtype: str):
    """``torch.autocast`` in ``amp_dtype`` on ``device`` (``auto``: see ``fast_dtype``); none for float32."""
    dtype = resolve_dtype(amp_dtype, device)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def warn_if_amp_is_emulated(device: torch.device, amp_dtype: str) -> None:
    """Warn when CPU autocast would run without native reduced-precision matmuls.

    Without AMX, bf16 GEMMs run slower than float32 (emulated on AVX2; with
    AVX512-BF16 alone too: ``docs/costs.md``, see :func:`ced_csa2.model_utils.fast_dtype`); the fix is
    ``amp_dtype: float32`` for that run.
    """
    if device.type != "cpu" or amp_dtype in ("float32", "auto"):
        return
    if not torch.cpu._is_amx_tile_supported():
        log.warning("%s autocast on a CPU without AMX (%s): reduced-precision matmuls are emulated "
                    "and much slower than float32; consider amp_dtype: float32", amp_dtype,
                    torch.backends.cpu.get_cpu_capability())


KEEP_CHOICES = ("best_val", "last")  # which epoch's weights fit() ends with


def warmup_cosine(total_steps: int, warmup_fraction: float):
    """LR multiplier: linear warm-up over ``warmup_fraction`` of the steps, then cosine decay to 0."""
    warmup = max(1, round(warmup_fraction * total_steps)) if warmup_fraction > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


@torch.no_grad()
def evaluate(heads: list[Head], batches: Batches, device: torch.device) -> list[dict[str, dict]]:
    """Held-out metrics of every head, in float32 whatever the training autocast.

    Returns
    -------
    list
        Per head, ``{part: {"r2", "cos", "rel_mse", "mse", "n"}}``.
    """
    stats = [{part: FitStats() for part in h.parts} for h in heads]
    for X, Y in batches:
        lo, hi = distributed.bounds(len(X))  # this rank's slice of the batch
        X, Y = X[lo:hi].to(device, torch.float32), Y[lo:hi].to(device, torch.float32)
        for h, st in zip(heads, stats):
            pred, true = h.module(X[:, h.x]), Y[:, h.y]
            for part, cols in h.parts.items():
                st[part].update(pred[:, cols], true[:, cols])
    per_rank = distributed.gather(stats)
    return [{part: s.result() for part, s in merged([r[i] for r in per_rank]).items()} for i in range(len(heads))]


def val_summary(result: dict[str, dict]) -> tuple[float, float]:
    """``(val_loss, val_cos)`` of one head: means over its equal-width parts."""
    return (sum(r["mse"] for r in result.values()) / len(result),
            sum(r["cos"] for r in result.values()) / len(result))


def train_epoch(heads: list[Head], optimizer: torch.optim.Optimizer, batches: Batches, device: torch.device,
                amp_dtype: str, scheduler=None, bar: Progress | None = None) -> list[float]:
    """One pass over ``batches`` (MSE per head, summed); returns each head's row-weighted mean loss.

    Under a process group this rank trains on its slice of each batch, its loss weighted by
    ``world × slice / batch`` so that DDP's gradient average is the whole batch's gradient.
    """
    for h in heads:
        h.module.train()
    loss_sums, n = torch.zeros(len(heads), device=device), 0
    for X, Y in batches:
        lo, hi = distributed.bounds(len(X))
        weight = (hi - lo) * distributed.world_size() / len(X)  # 1.0 with one process
        n += len(X)
        X, Y = X[lo:hi].to(device, non_blocking=True), Y[lo:hi].to(device, non_blocking=True)
        with amp_context(device, amp_dtype):
            preds = [h.module(X[:, h.x]) for h in heads]
        # The loss in float32: a bf16 MSE would round away the small errors being fitted.  A rank
        # with no rows of a short last batch still joins DDP's all-reduce, with zero gradients.
        losses = torch.stack([F.mse_loss(p.float(), Y[:, h.y]) if hi > lo else p.sum() * 0.0
                              for p, h in zip(preds, heads)])
        optimizer.zero_grad(set_to_none=True)
        (losses.sum() * weight).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        loss_sums += losses.detach() * (hi - lo)
        if bar is not None:
            bar.update()
    for h in heads:
        h.module.eval()
    distributed.all_reduce_sum(loss_sums)
    return (loss_sums / n).tolist()


def fit(heads: list[Head], optimizer: torch.optim.Optimizer, train: Batches, val: Batches, *, epochs: int,
        device: torch.device, amp_dtype: str, keep: str = "best_val",
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        desc: str = "train") -> tuple[dict, list[dict], list[dict], list[int]]:
    """Train all heads together with MSE, validating before the first and after every epoch.

    With ``keep="best_val"`` each head ends with the weights of the epoch (0 = its start)
    whose held-out MSE was lowest -- a start that is already the least-squares optimum (the
    ridge map) is kept when training only adds optimizer noise to it; ``keep="last"`` keeps
    the last epoch's weights.

    Parameters
    ----------
    heads
        The maps; their modules must already be on ``device``.
    optimizer, scheduler
        Over all heads' parameters; the scheduler (if any) steps once per batch.
    train, val
        Training batches (``set_epoch(e)`` before epoch ``e``) and validation batches.
    epochs, device, amp_dtype
        Passes over ``train``, where to compute, the autocast dtype of training steps.

    Returns
    -------
    curves
        One series per head and quantity, x = epoch (the loop logs once per epoch), keyed
        ``(curve_name(head.label), quantity)``: ``val_loss`` and ``val_cos`` from epoch 0
        (before training), ``train_loss`` (row-weighted mean over the epoch) from epoch 1;
        :func:`write_curves` writes them.
    initial, final
        Per head, the :func:`evaluate` results before training and of the weights it ends with.
    kept
        Per head, the epoch whose weights it ends with (0 = the start).
    """
    if keep not in KEEP_CHOICES:
        raise ValueError(f"fit: keep must be one of {KEEP_CHOICES}, got {keep!r}")
    warn_if_amp_is_emulated(device, amp_dtype)
    initial = evaluate(heads, val, device)
    trained = heads
    if distributed.world_size() > 1:  # the same heads, their gradients averaged over the ranks
        ids = [device.index] if device.type == "cuda" else None
        trained = [replace(h, module=DistributedDataParallel(h.module, device_ids=ids)) for h in heads]
    result = initial
    names = [curve_name(h.label) for h in heads]
    if len(set(names)) != len(names):
        raise ValueError(f"heads need distinct labels, got {names}")
    if len({id(h.module) for h in heads}) != len(heads):
        raise ValueError("heads need distinct modules: each ends with the weights of its own best epoch")
    curves: Curves = {}
    for name, res in zip(names, initial):
        curves[name, "train_loss"] = []
        curves[name, "val_loss"], curves[name, "val_cos"] = [(0, val_summary(res)[0])], [(0, val_summary(res)[1])]
    # Per head: (held-out MSE, epoch, results, weights) of the epoch it will end with.
    best = [(val_summary(res)[0], 0, res, _weights(h)) for h, res in zip(heads, initial)]
    with Progress(total=epochs * len(train), desc=desc, unit="step", disable=not distributed.is_main()) as bar:
        for epoch in range(1, epochs + 1):
            train.set_epoch(epoch)
            train_loss = train_epoch(trained, optimizer, train, device, amp_dtype, scheduler, bar)
            result = evaluate(heads, val, device)
            summaries = [val_summary(res) for res in result]
            for name, tl, (vl, vc) in zip(names, train_loss, summaries):
                curves[name, "train_loss"].append((epoch, tl))
                curves[name, "val_loss"].append((epoch, vl))
                curves[name, "val_cos"].append((epoch, vc))
            for i, (h, res, (vl, _)) in enumerate(zip(heads, result, summaries)):
                if keep == "last" or vl < best[i][0]:
                    best[i] = (vl, epoch, res, _weights(h))
            mean_val = sum(vl for vl, _ in summaries) / len(heads)
            bar.set_postfix(val_loss=f"{mean_val:.4g}")
            log.info("%s epoch %d/%d: train loss %.5g, val loss %.5g, val cos %.4f (means over %d maps)", desc,
                     epoch, epochs, sum(train_loss) / len(heads), mean_val,
                     sum(vc for _, vc in summaries) / len(heads), len(heads))
    for h, (_, _, _, weights) in zip(heads, best):
        h.module.load_state_dict(weights)
    return curves, initial, [b[2] for b in best], [b[1] for b in best]


def _weights(head: Head) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in head.module.state_dict().items()}


# ----------------------------------------------------------------------------- outputs

def curve_name(label: dict) -> str:
    """A head's series prefix: ``{"layer": 24, "kind": "k"}`` -> ``layer24_k`` (numbers keep their key)."""
    return "_".join(f"{k}{v}" if isinstance(v, int) else str(v) for k, v in label.items())


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

# A stage's curves: ``{(series, quantity): [(x, value), ...]}``, e.g. ``("layer22_k", "val_loss")``.
Curves = dict[tuple[str, str], list[tuple[int, float]]]
CURVE_COLUMNS = ("quantity", "series", "value")  # after the x column


def write_curves(path: Path, curves: Curves, x: str = "step") -> None:
    """A stage's training curves as one long-format table ``path``: one ``dvc plots show`` panel per stage.

    Header ``<x>\tquantity\tseries\tvalue``, then one row per point, grouped by quantity and
    series (floats with 8 significant digits).  ``.dvc/plots/curves.json`` draws it as one plot:
    a row per quantity (``train_loss``, ``val_loss``, ``val_cos``, ``val_kl``), a line per series
    (a head such as ``layer22_k``, a phase such as ``ced``).  ``x`` names the unit: ``step``
    (optimizer steps, one counter for the whole stage) or ``epoch``.  A series must be non-empty
    with strictly increasing ``x``.  No curves (a stage that trains nothing) write the header only.
    """
    for (series, quantity), points in curves.items():
        xs = [int(p[0]) for p in points]
        if not (_NAME.fullmatch(series) and _NAME.fullmatch(quantity)):
            raise ValueError(f"curve {series!r} / {quantity!r}: use letters, digits, '_', '.', '-'")
        if not points or any(b <= a for a, b in itertools.pairwise(xs)):
            raise ValueError(f"curve {series!r} / {quantity!r}: needs points with strictly increasing {x}, got {xs}")
    rows = "".join(f"{int(s)}\t{quantity}\t{series}\t{float(v):.8g}\n"
                   for (series, quantity), points in sorted(curves.items(), key=lambda kv: kv[0][::-1])
                   for s, v in points)
    atomic_write_text(Path(path), "\t".join((x, *CURVE_COLUMNS)) + "\n" + rows)


KINDS = ("k", "v")



def pair_names(plan: LayerPlan) -> tuple[list[str], list[str]]:
    """Dataset names of the inputs ``[k_src, v_src]`` and the targets ``[k_t1, v_t1, k_t2, ...]``."""
    return [f"{kind}_{plan.source}" for kind in KINDS], [f"{kind}_{t}" for t in plan.targets for kind in KINDS]



def build_adapters(params: Params, plan: LayerPlan, kv_dim: int, ridge_path: Path,
                   projected: bool = False) -> CSA2Adapters:
    """Seeded adapters (``train_adapters.input``) whose bases hold their ridge maps (MLPs at their zero start).

    ``projected``: the maps fitted on the projected source (``ced_csa2``'s adapters).
    """
    cfg = params.train_adapters
    names = {(kind, t): adapter_map(kind, t, cfg.input, projected) for t in plan.targets for kind in KINDS}
    maps = ridge_maps(ridge_path, list(names.values()), params)
    torch.manual_seed(params.seed)
    adapters = CSA2Adapters(plan.targets, kv_dim, width_mult=cfg.width_mult, activation=cfg.activation,
                            input=cfg.input)
    for (kind, t), name in names.items():
        adapters.adapter(kind, t).init_from_ridge(maps[name]["W"], maps[name]["b"])
    return adapters

