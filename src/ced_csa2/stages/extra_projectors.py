"""``extra_projectors`` stage: a covering plan's extra sources ``H_split -> K_l ‖ V_l``.

    python -m ced_csa2.stages.extra_projectors     # what `dvc repro extra_projectors` runs

Mode A (the prefill skip) needs K/V for every attention layer above the cut.  On Qwen3.5-4B
the source and the targets are all of them; on the all-attention embedded model the plan
lists the others as ``plan.extra_sources``, one projector each:

* ``extra_projectors: ridge`` (default): the ridge stage's closed-form ``proj_{l}`` maps of
  ``models/ridge.pt`` as they are -- the least-squares optimum of the same linear map, at no
  training cost;
* ``extra_projectors: trained``: ``train_projector``'s recipe (seeded AdamW from PyTorch's
  init) for each of them; the held-out loss before and after training is in the metrics
  (no per-epoch curves: a plot definition for a folder that exists only in this setting
  is an error for ``dvc plots show`` in the default one).

Either way every map is validated on every token of the held-out records (the ridge
stage's split).  Writes ``models/projectors_extra.pt`` (empty for a plan without extra
sources: nothing is read then) and ``metrics/extra_projectors.json``
(``layers.<l>``: r2, cos, rel_mse, mse for K and V, ``maps``; ``run``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from ..config import Params, provenance
from ..maps.ridge import ridge_provenance
from ..pipeline.atomic_files import write_json
from ..pipeline.checkpoint import checkpoint_meta
from ..pipeline.map_roles import MAIN
from ..pipeline.paths import DUMP_PATH, EXTRA_METRICS, PROJECTORS_EXTRA, RIDGE_PATH
from ..pipeline.stage_runner import run_stage, stage_arguments
from ..plan import load_plan
from ..projector import save_projectors
from ..train.projector_training import Fitted, ridge_fitted, train_projectors
from ..train.training import split_masks

log = logging.getLogger(__name__)

PROVENANCE = ("seed", "model", "plan", "split", "extra_projectors", "train_projector")  # of dvc.yaml's params for extra_projectors


def run(params: Params, workdir: Path = Path(".")) -> dict:
    """Fit (or take from ridge), validate and save the extra projectors; returns the metrics written."""
    workdir = Path(workdir)
    plan, geo = load_plan(params.plan, params.model)
    layers, dump = plan.extra_sources, workdir / DUMP_PATH
    # Read whatever the plan: dvc.yaml declares train_projector for this stage, whose recipe
    # the trained setting follows and whose batch size both settings validate with.
    recipe, val_batch = params.train_projector, params.train_projector.batch_size
    fitted = Fitted({}, {}, {}, {})
    if layers:
        train_mask, val_mask = split_masks(dump, params, plan, geo, layers, tokens_per_record=0)
        if params.extra_projectors == "trained":
            fitted = train_projectors(params, dump, layers, geo, train_mask, val_mask, desc="extra_projectors",
                                      ridge=workdir / RIDGE_PATH)
        else:
            fitted = ridge_fitted(params, dump, workdir / RIDGE_PATH, list(layers), geo, val_mask, val_batch)
    trained = (recipe,) if params.extra_projectors == "trained" else ()
    made_from = {**(ridge_provenance(workdir / RIDGE_PATH) if layers else {}), **provenance(params, *PROVENANCE)}
    meta = checkpoint_meta(params, plan, geo, params.model, params.plan, params.split, *trained,
                           role=MAIN, provenance=made_from)["projectors"]
    save_projectors(workdir / PROJECTORS_EXTRA, fitted.projectors, {**meta, "maps": params.extra_projectors})
    metrics = {"layers": {str(layer): m for layer, m in fitted.layers.items()},
               "run": {"maps": params.extra_projectors, **fitted.run}}
    write_json(workdir / EXTRA_METRICS, metrics)
    for layer, m in metrics["layers"].items():
        log.info("extra projector H_%d -> KV_%s (%s): val R2 K %.4f V %.4f", plan.split, layer, m["maps"],
                 m["k"]["r2"], m["v"]["r2"])
    return metrics


def main(argv: Sequence[str] | None = None) -> None:
    run_stage(run, *stage_arguments(run, argv))


if __name__ == "__main__":
    main()
