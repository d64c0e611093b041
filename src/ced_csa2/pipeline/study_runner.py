"""How a study starts: ``python studies/<study>.py`` ends as a stage does.

A study reads the pipeline's outputs through the stages' own loaders and checks, so a missing,
stale or corrupt input raises the stages' errors; :func:`run_study` answers them as
:func:`~ced_csa2.pipeline.stage_runner.run_stage` does: ``error: <message>`` on one line and exit
status 2 for an input error or the GPU out of memory, one line and 130 for Ctrl-C, the traceback
with ``CED_CSA2_DEBUG=1`` or for anything else (a bug).  A study is no stage (no ``timings/<stage>.json``, no read log), so
it runs its own ``main`` rather than through :func:`~ced_csa2.pipeline.stage_runner.run_stage`.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path

from .stage_runner import DEBUG_ENV, INTERRUPTED, error_line, is_input_error, is_out_of_memory, out_of_memory_line


def run_study(main: Callable[[], object]) -> None:
    """Call a study's ``main()``; end an input error or Ctrl-C in one line, as a stage ends.

    Parameters
    ----------
    main
        The study's entry point, defined in ``studies/<study>.py`` (its file names the study in
        the Ctrl-C line).

    Raises
    ------
    SystemExit
        Status 2 after an input error (:func:`~ced_csa2.pipeline.stage_runner.is_input_error`)
        or the GPU out of memory, 130 after Ctrl-C, each with one line on stderr; with
        ``CED_CSA2_DEBUG=1`` the exception propagates instead, and any other exception always does.
    """
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        main()
    except KeyboardInterrupt:
        if debug:
            raise
        # Every study writes its outputs through atomic_files, and its scratch folders are temporary ones.
        print(f"{Path(inspect.getfile(main)).stem}: interrupted; every output is its complete old or new file "
              "(none is left half-written): run the study again to finish", file=sys.stderr, flush=True)
        raise SystemExit(INTERRUPTED) from None
    except Exception as exc:
        out_of_memory = is_out_of_memory(exc)
        if not (out_of_memory or is_input_error(exc)) or debug:
            raise
        print(out_of_memory_line(Path(inspect.getfile(main)).stem, exc) if out_of_memory else error_line(exc),
              file=sys.stderr, flush=True)
        raise SystemExit(2) from None
