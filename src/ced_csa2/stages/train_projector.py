"""``train_projector`` stage: the CED projector ``H_split -> K_src ‖ V_src`` of the source layer.

    python -m ced_csa2.stages.train_projector     # what `dvc repro train_projector` runs

Reads ``params.yaml``, ``data/dump/dump.h5`` and (``init: ridge``) ``models/ridge.pt``.
Validates the plan and the dump first; splits the records as the ridge stage does
(:func:`ced_csa2.data.loader.record_split`) and trains one :class:`~ced_csa2.projector.KVProjector`
on every token of the training records
(:func:`ced_csa2.train.projector_training.train_projectors`):

* loss: MSE on ``K ‖ V``; AdamW (``lr``, ``weight_decay``); linear warm-up over
  ``warmup_fraction`` of the steps, then cosine decay to 0; ``torch.autocast`` in
  ``amp_dtype`` (none for float32); ``epochs`` passes of ``batch_size`` rows;
* start: PyTorch's default init (``init: random``, the seed's) or the ridge stage's
  closed-form ``proj_{src}`` map (``init: ridge``);
* seeded (``params.seed``): initial weights, shuffling, split;
* validation (float32) on every token of the held-out records, before training and
  after each epoch;
* data-parallel (``distributed.nproc``): each rank trains on its slice of every global
  batch under ``DistributedDataParallel`` (:mod:`ced_csa2.train.training`), so the batches, their
  order and the steps are those of one process; rank 0 writes.

A covering plan's extra sources are the ``extra_sources`` stage's.

Beside it, the seed's recipe read literally -- PyTorch's default init, the last epoch's
weights (``init: random, keep: last``), all else the same -- is trained as a reference
(the report's ``ced`` row "seed init"; it is the main projector itself when the params
already say so) and written to ``models/projector_seed_init/projector_k{src}v{src}.pt``.

Writes ``models/projector_k{src}v{src}.pt``, the curves
``metrics/curves/train_projector.tsv`` (series ``layer{src}``: ``train_loss``, ``val_loss``,
``val_cos`` by epoch, ``val_*`` from epoch 0 = before training; ``val_*`` are means of the
K and V halves) and ``metrics/projector.json`` (``layers.<src>``: r2, cos, rel_mse, mse for K
and V, the val loss before and after training, the kept epoch; ``run``: facts; ``seed_init``:
the same for the reference).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from ..config import Params, provenance
from ..data.dump_file import dump_provenance
from ..maps.ridge import ridge_provenance
from ..pipeline import distributed
from ..pipeline.atomic_files import write_json
from ..pipeline.checkpoint import checkpoint_meta
from ..pipeline.map_roles import MAIN, SEED_INIT_ROLE, applied
from ..pipeline.paths import (
    DUMP_PATH,
    PROJECTOR_CURVES,
    PROJECTOR_METRICS,
    RIDGE_PATH,
    SEED_INIT_MODELS,
    projector_path,
)
from ..pipeline.stage_runner import run_stage, stage_arguments
from ..plan import load_plan
from ..projector import save_projector
from ..train.projector_training import train_projectors
from ..train.training import split_masks, write_curves

log = logging.getLogger(__name__)

PROVENANCE = ("seed", "model", "plan", "split", "train_projector")  # of dvc.yaml's params for train_projector


def run(params: Params, workdir: Path = Path(".")) -> dict:
    """Train, validate and save the source's projector; returns ``metrics/projector.json``'s content."""
    with distributed.session(params.distributed):
        return _run(params, Path(workdir))


def _run(params: Params, workdir: Path) -> dict:
    plan, geo = load_plan(params.plan, params.model)
    dump = workdir / DUMP_PATH
    train_mask, val_mask = split_masks(dump, params, plan, geo, [plan.source], tokens_per_record=0)
    fitted = train_projectors(params, dump, (plan.source,), geo, train_mask, val_mask, desc="train_projector",
                               ridge=workdir / RIDGE_PATH)
    # The seed-literal reference is the same stage under SEED_INIT_RECIPE: its file records the
    # params as applied (init: random, keep: last), which its reader checks it against.
    seed_params = applied(params, SEED_INIT_ROLE)
    literal = seed_params.train_projector
    seed = fitted if literal == params.train_projector else train_projectors(
        params, dump, (plan.source,), geo, train_mask, val_mask, desc="train_projector (seed init)",
        ridge=workdir / RIDGE_PATH, cfg=literal)
    dumped = dump_provenance(dump)
    meta, seed_meta = (
        checkpoint_meta(p, plan, geo, p.model, p.plan, p.split, p.train_projector, role=role,
                        provenance=made_from(p, workdir, dumped))["projector"]
        for p, role in ((params, MAIN), (seed_params, SEED_INIT_ROLE)))
    metrics = {"layers": {str(layer): m for layer, m in fitted.layers.items()},
               "run": fitted.run,
               "seed_init": {"layers": {str(layer): m for layer, m in seed.layers.items()}, "run": seed.run}}
    if distributed.is_main():
        save_projector(workdir / projector_path(plan.source), fitted.projectors[plan.source], meta)
        save_projector(workdir / projector_path(plan.source, SEED_INIT_MODELS), seed.projectors[plan.source],
                       seed_meta)
        write_curves(workdir / PROJECTOR_CURVES, fitted.curves, x="epoch")
        write_json(workdir / PROJECTOR_METRICS, metrics)
    for layer, m in metrics["layers"].items():
        log.info("projector H_%d -> KV_%s: val R2 K %.4f V %.4f, cos K %.4f V %.4f", plan.split, layer,
                 m["k"]["r2"], m["v"]["r2"], m["k"]["cos"], m["v"]["cos"])
    return metrics


def made_from(params: Params, workdir: Path, dumped: dict) -> dict:
    """The provenance of a projector trained with ``params``: the dump's (``dumped``), the ridge maps'
    (``init: ridge`` only: a random start reads none) and its own params."""
    ridge = ridge_provenance(workdir / RIDGE_PATH) if params.train_projector.init == "ridge" else {}
    return {**dumped, **ridge, **provenance(params, *PROVENANCE)}


def main(argv: Sequence[str] | None = None) -> None:
    run_stage(run, *stage_arguments(run, argv), launcher=distributed.relaunch)


if __name__ == "__main__":
    main()
