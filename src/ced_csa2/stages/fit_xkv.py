"""``fit_xkv`` stage: the xKV baseline's cross-layer SVD bases, fitted in closed form on the dump.

    python -m ced_csa2.stages.fit_xkv      # what `dvc repro fit_xkv` runs

Reads ``params.yaml`` and ``data/dump/dump.h5``.  On the ridge stage's train records (the
same record split and masks, :func:`ced_csa2.train.training.split_masks`, every token) it streams
the K of the group's layers ``(source, *targets)``, stacked along channels, into a float64
Gram matrix (likewise V), keeps the ``xkv.rank`` leading eigenvectors of each (``0`` =
``kv_dim``: per token exactly the bytes of CSA2's one shared entry) and measures the stored
(FP16) bases on the validation records (:mod:`ced_csa2.maps.xkv`).

Writes ``models/xkv.pt`` and ``metrics/xkv.json``:

* ``layers.{k,v}_{layer}``: held-out ``rel_err`` (``Σ‖x_l - x̂_l‖² / Σ‖x_l‖²``, the
  reconstruction error relative to the layer's K (V) energy), ``r2``, ``cos``, ``n_val``;
* ``energy.{k,v}``: captured energy ``Σ‖U_rᵀx‖² / Σ‖x‖²`` of the stacked rows, ``train``
  (from the eigenvalues) and ``val``;
* ``run``: rank, kv_dim, layers, rows and records on each side.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from ..config import Params, provenance
from ..data.dump_file import DumpReader, dump_provenance
from ..data.loader import aligned_block_rows
from ..maps.ridge import DUMP_ATTRS
from ..maps.xkv import XKVBasis, group_layers, save_xkv, top_eigenvectors
from ..maps.xkv_fit import BLOCK_ROWS, xkv_heldout, xkv_statistics
from ..pipeline.atomic_files import write_json
from ..pipeline.checkpoint import SAVE_DTYPE, checkpoint_meta
from ..pipeline.map_roles import MAIN
from ..pipeline.paths import DUMP_PATH, XKV_METRICS, XKV_PATH
from ..pipeline.stage_runner import run_stage, stage_arguments
from ..plan import load_plan
from ..train.training import split_masks

log = logging.getLogger(__name__)

PROVENANCE = ("seed", "model", "plan", "split.val_fraction", "xkv")  # of dvc.yaml's params for fit_xkv


def run(params: Params, workdir: Path = Path(".")) -> dict:
    """Fit, validate and write the xKV bases; returns the metrics written to ``metrics/xkv.json``."""
    workdir = Path(workdir)
    plan, geo = load_plan(params.plan, params.model)
    layers = group_layers(plan)
    rank, width = params.xkv.rank_for(geo.kv_dim), len(layers) * geo.kv_dim
    if rank > width:
        raise ValueError(f"params key 'xkv.rank' is {rank}, above the {width} channels the basis spans "
                         f"(layers {list(layers)} x kv_dim {geo.kv_dim})")
    dump = workdir / DUMP_PATH
    train_mask, val_mask = split_masks(dump, params, plan, geo, layers, 0)  # the ridge stage's masks
    with DumpReader(dump) as reader:
        block_rows = aligned_block_rows(reader, BLOCK_ROWS)
        log.info("xkv rank %d of %d (layers %s, kv_dim %d) on %s: %d train rows, %d val rows", rank, width,
                 list(layers), geo.kv_dim, reader.path, train_mask.sum(), val_mask.sum())
        accs = xkv_statistics(reader, layers, train_mask, block_rows)
        fitted = XKVBasis.from_grams({kind: acc.gram for kind, acc in accs.items()}, layers, geo.kv_dim, rank)
        # Measure what the file will hold: the FP16-rounded bases.
        stored = fitted.to(SAVE_DTYPE).float()
        fit = xkv_heldout(reader, stored, val_mask, block_rows)
        dump_attrs = {k: str(reader.attrs[k]) for k in DUMP_ATTRS if k in reader.attrs}
    energy = {}
    for kind, acc in accs.items():
        evals = top_eigenvectors(acc.gram, rank)[1]
        energy[kind] = {"train": float(evals[:rank].sum() / evals.sum()), "val": fit["energy_val"][kind]}
    for name, f in fit["layers"].items():
        log.info("%-6s val rel_err %.4f  R2 %.4f  cos %.4f", name, f["rel_err"], f["r2"], f["cos"])
    log.info("captured energy: %s", {k: {s: round(v, 4) for s, v in e.items()} for k, e in energy.items()})
    n_train, n_val = int(train_mask.sum()), int(val_mask.sum())
    made_from = {**dump_provenance(dump), **provenance(params, *PROVENANCE)}
    meta = {**checkpoint_meta(params, plan, geo, params.plan, params.xkv, role=MAIN, provenance=made_from)["xkv"],
            "val_fraction": params.split.val_fraction, "n_train_rows": n_train, "dump": dump_attrs,
            "energy_train": {kind: e["train"] for kind, e in energy.items()}}
    save_xkv(workdir / XKV_PATH, stored, meta)
    metrics = {
        "layers": fit["layers"],
        "energy": energy,
        "run": {"rank": rank, "kv_dim": geo.kv_dim, "layers": list(layers), "width": width,
                "n_train_rows": n_train, "n_val_rows": n_val},
    }
    write_json(workdir / XKV_METRICS, metrics)
    log.info("wrote %s and %s", workdir / XKV_PATH, workdir / XKV_METRICS)
    return metrics


def main(argv: Sequence[str] | None = None) -> None:
    run_stage(run, *stage_arguments(run, argv))


if __name__ == "__main__":
    main()
