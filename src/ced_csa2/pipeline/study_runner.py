"""How a study or a benchmark starts: ``python studies/<study>.py`` ends as a stage does.

A study reads the pipeline's outputs through the stages' own loaders and checks, so a missing,
stale or corrupt input raises the stages' errors; :func:`run_study` answers them as
:func:`~ced_csa2.pipeline.stage_runner.run_stage` does: ``error: <message>`` on one line and exit
status 2 for an input error or the GPU out of memory, one line and 130 for Ctrl-C, the traceback
with ``CED_CSA2_DEBUG=1`` or for anything else (a bug).  Its arguments are parsed first
(:class:`~ced_csa2.pipeline.cli.ArgumentParser`): a study without any refuses a stray one in two
lines, before any work.  A study is no stage (no ``timings/<stage>.json``, no read log), so
it runs its own ``main`` rather than through :func:`~ced_csa2.pipeline.stage_runner.run_stage`.
``python benchmarks/<benchmark>.py`` ends an input error the same way (:func:`run_main`).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .cli import ArgumentParser
from .stage_runner import DEBUG_ENV, INTERRUPTED, error_line, is_input_error, is_out_of_memory, out_of_memory_line

T = TypeVar("T")


def run_study(main: Callable[..., object], arguments: argparse.ArgumentParser | None = None) -> None:
    """Parse the command line, call a study's ``main``; end an input error or Ctrl-C in one line, as a stage ends.

    Parameters
    ----------
    main
        The study's entry point, defined in ``studies/<study>.py`` (its file names the study in
        the Ctrl-C line and the usage): ``main(args)`` with ``arguments``, ``main()`` without.
    arguments
        The study's arguments; ``None``: it takes none.

    Raises
    ------
    SystemExit
        Status 2 after an input error (:func:`~ced_csa2.pipeline.stage_runner.is_input_error`)
        or the GPU out of memory, 130 after Ctrl-C, each with one line on stderr; with
        ``CED_CSA2_DEBUG=1`` the exception propagates instead, and any other exception always does.
        A bad argument: status 2, the usage and one error line.
    """
    script = Path(inspect.getfile(main))
    takes_arguments = arguments is not None
    parser = arguments if takes_arguments else ArgumentParser(
        prog=f"python studies/{script.name}", description=(inspect.getmodule(main).__doc__ or "").split("\n\n")[0])
    args = parser.parse_args()  # before any work: a stray or misspelt argument is two lines
    try:
        run_main(functools.partial(main, args) if takes_arguments else main, script.stem)
    except KeyboardInterrupt:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        # Every study writes its outputs through atomic_files, and its scratch folders are temporary ones.
        print(f"{script.stem}: interrupted; every output is its complete old or new file "
              "(none is left half-written): run the study again to finish", file=sys.stderr, flush=True)
        raise SystemExit(INTERRUPTED) from None


def run_main(main: Callable[[], T], name: str | None = None) -> T:
    """``main()``, ended as a stage ends on an input error or the GPU out of memory: one line, exit status 2.

    What ``python benchmarks/<benchmark>.py`` runs (its ``main`` parses its own arguments), and
    :func:`run_study` too.  ``name`` names the run in the out-of-memory line (default: ``main``'s file).
    With ``CED_CSA2_DEBUG=1``, or for any other exception (a bug), the traceback.
    """
    try:
        return main()
    except Exception as exc:
        out_of_memory = is_out_of_memory(exc)
        if not (out_of_memory or is_input_error(exc)) or os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        print(out_of_memory_line(name or Path(inspect.getfile(main)).stem, exc) if out_of_memory else error_line(exc),
              file=sys.stderr, flush=True)
        raise SystemExit(2) from None
