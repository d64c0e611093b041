"""``tune@<objective>`` stages: the maps trained with another objective, from the ridge solution.

    python -m ced_csa2.stages.tune distill     # what `dvc repro tune@distill` runs

One pipeline branch per entry of ``train.objectives`` (``dvc.yaml`` loops over it), each
starting from the closed-form maps of ``models/ridge.pt``: the projector's ``proj_{source}``
map and the adapters' ``k_{t}`` / ``v_{t}`` bases (MLPs at their zero start).

Each group is served by maps trained for it: ``ced`` and ``csa2`` by one projector and
one set of adapters (fitted on the true source K/V, as ``csa2`` reads them), ``ced_csa2``
by its own pair from the ridge start -- its adapters from ``csa2``'s maps or
(``train.ced_csa2_start: projected``) from the maps fitted on the *projected* source (the
ridge stage's ``ced_{k,v}_{t}*`` maps).

* ``ridge``: the start itself, untrained -- the reference every objective must beat.
* ``attn_out`` / ``distill`` (:mod:`ced_csa2.train.objective_registry`): three phases through the frozen
  model, on ``train.online.records`` records of the train split (the ridge stage's split),
  cropped to ``seq_len`` tokens: the projector under the ``ced`` substitution, the
  adapters under ``csa2`` (true source K/V), then ``ced_csa2``'s projector and adapters
  jointly under ``ced_csa2``.  AdamW (``projector_lr`` /
  ``adapters_lr`` per kind of map) with warm-up + cosine; held-out objective loss and KL
  (T = 1) on ``val_records`` records of the validation split before and after each phase.

Writes ``models/objectives/<objective>/{projector_k{s}v{s}.pt, adapters.pt}`` and the same
pair in ``.../ced_csa2/`` (:func:`ced_csa2.ced_runtime.save_parts`, in the main branch's formats, so
:func:`ced_csa2.ced_runtime.load_parts` reads them),
``metrics/objectives/<objective>/train.json`` (per phase: steps, tokens, wall time,
tokens/s, held-out losses) and, for the objectives that train, its curves
``metrics/curves/tune/<objective>.tsv``: one series per phase (``ced``, ``csa2``, ``ced_csa2``),
x = the optimizer step counted across the phases (each phase's steps continue after the
previous one's); ``train_loss`` per step, ``val_loss`` / ``val_kl`` the held-out values at the
phase's first and last step.  ``ridge`` trains nothing: its table is the header alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..ced_runtime import save_parts
from ..config import Params, provenance, require_listed
from ..data.records import check_prepared
from ..maps.ridge import ridge_provenance
from ..model_utils import load_model_and_tokenizer, resolve_device
from ..pipeline.atomic_files import write_json
from ..pipeline import map_roles
from ..pipeline.checkpoint import checkpoint_meta
from ..pipeline.map_roles import PAIRS
from ..pipeline.paths import RIDGE_PATH, TRAIN_JSONL, objective_curves, objective_metrics, objective_pair_models
from ..pipeline.stage_runner import run_stage, stage_arguments
from ..plan import load_plan
from ..train.objective_registry import tune_objective
from ..train.training import Curves, write_curves
from ..train.tuning import ridge_served, train_branch

# of dvc.yaml's params for tune@<objective>: every objective's (each adds its own: TuneObjective.provenance)
PROVENANCE = ("seed", "model", "plan", "split", "ridge", "train_adapters.width_mult", "train_adapters.activation",
              "train_adapters.input", "train.ced_csa2_start")


def run(params: Params, objective: str, workdir: Path = Path("."), *, model_and_tok=None) -> dict:
    """Build (and, for an objective that trains, train) one objective's maps; returns ``train.json``'s content."""
    workdir = Path(workdir)
    require_listed(params, objective)
    spec = tune_objective(objective)
    plan, geo = load_plan(params.plan, params.model)
    if spec.trains:  # the objectives that train read the training records
        check_prepared(params, workdir, TRAIN_JSONL)
    served = ridge_served(params, plan, geo, workdir)
    metrics: dict = {"objective": objective, "init": "ridge", "phases": {}}
    curves: Curves = {}
    if spec.trains:
        model, tok = model_and_tok or load_model_and_tokenizer(params.model, device=resolve_device("auto"))
        metrics["phases"], curves, metrics["protocol"] = train_branch(objective, params, plan, served, model, tok,
                                                                      workdir)
    # An objective that trains nothing does not depend on the online budget or the data: same params, same bytes.
    made_from = {**ridge_provenance(workdir / RIDGE_PATH), **provenance(params, *PROVENANCE, *spec.provenance)}
    for pair in PAIRS:
        meta = checkpoint_meta(params, plan, geo, params.model, params.plan, params.split, params.ridge,
                               *([params.train.online] if spec.trains else []),
                               role=map_roles.objective(objective, pair), provenance=made_from)
        save_parts(workdir / objective_pair_models(objective, pair), served[pair], plan, meta, extra_sources=False)
    # ridge trains nothing: its (declared) curve table is the header alone, not a flat line
    write_curves(workdir / objective_curves(objective), curves, x="step")
    write_json(workdir / objective_metrics(objective) / "train.json", metrics)
    return metrics


def main(argv: Sequence[str] | None = None) -> None:
    run_stage(run, *stage_arguments(run, argv, "objective"))


if __name__ == "__main__":
    main()
