"""``check_params`` stage: every edit of ``params.yaml`` is validated, whatever it touches.

    python -m ced_csa2.stages.check_params     # what `dvc repro check_params` runs

Every other stage declares only the keys it reads, so DVC re-runs nothing after an edit
that no stage reads -- a misspelt new top-level key, say -- and no stage would ever refuse
it.  This one declares the whole file: DVC runs it after any edit (seconds), and
:func:`ced_csa2.pipeline.stage_runner.run_stage` validates ``params.yaml`` first, so ``dvc repro`` fails with
one line naming the key.  The layer plan is validated too, against the model's geometry
(:func:`ced_csa2.plan.load_plan`, from the model's config alone, as every stage that reads the plan
checks it): a plan the model cannot take is refused here, before ``dvc repro`` runs a stage that
would refuse it only after DVC deleted that stage's outputs (the dump's first).  It writes the
validated params, every default filled in (``data/params.json``): a stage needs an output for DVC's
run cache to restore it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from ..config import Params, params_hash, to_dict
from ..pipeline.atomic_files import write_json
from ..pipeline.paths import VALIDATED_PARAMS
from ..pipeline.stage_runner import run_stage, stage_arguments

log = logging.getLogger(__name__)


def run(params: Params, workdir: Path = Path(".")) -> str:
    """Refuse a layer plan the model cannot take, then write the validated params (reading every key, as the whole
    file is declared); return their digest.

    Raises
    ------
    PlanError
        The plan does not fit the model's geometry (:meth:`ced_csa2.plan.LayerPlan.validate`), naming the layer.
    """
    # Imported here: the plan's geometry needs transformers and torch (seconds of imports), which a params.yaml refused
    # at load (the stage runner's own check, before this) never pays.
    from ..plan import load_plan

    load_plan(params.plan, params.model)
    digest = params_hash(params)
    write_json(Path(workdir) / VALIDATED_PARAMS, to_dict(params))
    log.info("params.yaml is valid (%s): %s", digest, VALIDATED_PARAMS)
    return digest


def main(argv: Sequence[str] | None = None) -> None:
    run_stage(run, *stage_arguments(run, argv))


if __name__ == "__main__":
    main()
