"""``check_params`` stage: every edit of ``params.yaml`` is validated, whatever it touches.

    python -m ced_csa2.stages.check_params     # what `dvc repro check_params` runs

Every other stage declares only the keys it reads, so DVC re-runs nothing after an edit
that no stage reads -- a misspelt new top-level key, say -- and no stage would ever refuse
it.  This one declares the whole file: DVC runs it after any edit (about a second), and
:func:`ced_csa2.entry.run_stage` validates ``params.yaml`` first, so ``dvc repro`` fails with
one line naming the key.  It writes nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..config import Params, params_hash
from ..entry import run_stage

log = logging.getLogger(__name__)


def run(params: Params, workdir: Path = Path(".")) -> str:
    """Log the digest of the validated params (reading every key, as the whole file is declared)."""
    digest = params_hash(params)
    log.info("params.yaml is valid (%s)", digest)
    return digest


def main() -> None:
    run_stage(run)


if __name__ == "__main__":
    main()
