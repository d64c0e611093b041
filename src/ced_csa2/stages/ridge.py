"""``ridge`` stage: closed-form maps fitted on the dump, and their held-out fit.

    python -m ced_csa2.stages.ridge      # what `dvc repro ridge` runs

Reads ``params.yaml`` and ``data/dump/dump.h5``; fits the maps of
:mod:`ced_csa2.maps.ridge` on the train records and measures them on the validation records
(``ced_{k,v}_{t}``: the adapters' maps from the projected source, and ``{k,v}_{t}_on_ced``:
the true-source maps fed the projected source, what ``ced_csa2`` gets without them).
Writes ``models/ridge.pt`` and ``metrics/ridge.json``.

Data-parallel (``distributed.nproc``): each rank streams its share of the row blocks, the
float64 sufficient statistics are summed across ranks, every rank solves; rank 0 writes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from ..config import Params, check_provenance, params_hash, provenance, to_dict
from ..data.dump_file import DumpReader
from ..data.loader import aligned_block_rows, record_split, row_mask
from ..maps.ridge import DUMP_ATTRS, MapGroup, evaluate_maps, fit_maps, map_groups, projected_groups, save_ridge
from ..pipeline import distributed
from ..pipeline.atomic_files import write_json
from ..pipeline.paths import DUMP_PATH, RIDGE_METRICS, RIDGE_PATH
from ..pipeline.stage_runner import run_stage, stage_arguments
from ..plan import LayerPlan

log = logging.getLogger(__name__)

PROVENANCE = ("seed", "plan", "split", "ridge")  # of dvc.yaml's params for ridge


def run(params: Params, workdir: Path = Path(".")) -> dict:
    """Fit, validate and write the ridge maps; returns the metrics written to ``metrics/ridge.json``."""
    with distributed.session(params.distributed):
        return _run(params, Path(workdir))


def _run(params: Params, workdir: Path) -> dict:
    plan, lam = LayerPlan.from_config(params.plan), params.ridge.lam
    groups = map_groups(plan)
    with DumpReader(workdir / DUMP_PATH) as reader:
        reader.check(kv_layers=plan.kv_layers)
        check_provenance(reader.path, reader.provenance(), params)
        made_from = {**reader.provenance(), **provenance(params, *PROVENANCE)}
        train, val = record_split(reader.n_records, params.split.val_fraction, params.seed)
        train_mask = row_mask(reader.record_offsets, train, 0, params.seed)
        val_mask = row_mask(reader.record_offsets, val, 0, params.seed)
        block_rows = aligned_block_rows(reader, params.ridge.block_rows)
        log.info("ridge lambda=%g on %s: %d train records (%d rows), %d val records (%d rows), blocks of %d rows",
                 lam, reader.path, len(train), train_mask.sum(), len(val), val_mask.sum(), block_rows)
        maps = fit_maps(reader, groups, train_mask, block_rows, lam)
        fits = evaluate_maps(reader, groups, maps, val_mask, block_rows)
        # ced_csa2's adapters, fitted on the source K/V its targets will read: the projected ones.
        ced_groups, derive = projected_groups(plan, maps[f"proj_{plan.source}"])
        maps |= fit_maps(reader, ced_groups, train_mask, block_rows, lam, derive)
        # ... and, for comparison, csa2's maps (fitted on the true source) fed the projected one.
        on_ced = [MapGroup(g.x, {f"{name.removeprefix('ced_')}_on_ced": ys for name, ys in g.maps.items()})
                  for g in ced_groups]
        fits |= evaluate_maps(reader, ced_groups + on_ced,
                              maps | {f"{n}_on_ced": maps[n] for g in groups[1:] for n in g.maps},
                              val_mask, block_rows, derive)
        dump_attrs = {k: str(reader.attrs[k]) for k in DUMP_ATTRS if k in reader.attrs}
    for name, f in fits.items():
        log.info("%-12s val R2 %.4f  cos %.4f  rel_mse %.4g", name, f["r2"], f["cos"], f["rel_mse"])
    meta = {
        "lambda": lam, "n_train_rows": int(train_mask.sum()), "n_train_records": len(train),
        "plan": to_dict(params.plan), "seed": params.seed, "dump": dump_attrs,
        "params_hash": params_hash(params.plan, params.split, params.ridge), "provenance": made_from,
    }
    metrics = dict(fits)
    metrics["run"] = {
        "lambda": lam, "n_train_rows": int(train_mask.sum()), "n_val_rows": int(val_mask.sum()),
        "n_train_records": len(train), "n_val_records": len(val),
    }
    if distributed.is_main():
        save_ridge(workdir / RIDGE_PATH, maps, meta)
        write_json(workdir / RIDGE_METRICS, metrics)
        log.info("wrote %s and %s", workdir / RIDGE_PATH, workdir / RIDGE_METRICS)
    return metrics


def main(argv: Sequence[str] | None = None) -> None:
    run_stage(run, *stage_arguments(run, argv), launcher=distributed.relaunch)


if __name__ == "__main__":
    main()
