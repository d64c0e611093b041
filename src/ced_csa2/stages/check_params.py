"""``check_params`` stage: every edit of ``params.yaml`` is validated, whatever it touches.

    python -m ced_csa2.stages.check_params     # what `dvc repro check_params` runs

Every other stage declares only the keys it reads, so DVC re-runs nothing after an edit
that no stage reads -- a misspelt new top-level key, say -- and no stage would ever refuse
it.  This one declares the whole file: DVC runs it after any edit (about a second), and
:func:`ced_csa2.pipeline.stage_runner.run_stage` validates ``params.yaml`` first, so ``dvc repro`` fails with
one line naming the key.  It writes the validated params, every default filled in
(``data/params.json``): a stage needs an output for DVC's run cache to restore it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..config import Params, params_hash, to_dict
from ..pipeline.atomic_files import write_json
from ..pipeline.paths import VALIDATED_PARAMS
from ..pipeline.stage_runner import run_stage

log = logging.getLogger(__name__)


def run(params: Params, workdir: Path = Path(".")) -> str:
    """Write the validated params (reading every key, as the whole file is declared); return their digest."""
    digest = params_hash(params)
    write_json(Path(workdir) / VALIDATED_PARAMS, to_dict(params))
    log.info("params.yaml is valid (%s): %s", digest, VALIDATED_PARAMS)
    return digest


def main() -> None:
    run_stage(run)


if __name__ == "__main__":
    main()
