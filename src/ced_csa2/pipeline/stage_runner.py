"""How a stage module starts: ``python -m ced_csa2.stages.<stage> [objective]``.

:func:`run_stage` loads and validates ``params.yaml``, then calls the stage's
``run(params, *args)`` from the repository root.  With ``CED_CSA2_RECORD_READS=<dir>`` it
also writes ``<dir>/<stage>.json``: the params keys and the project files the stage read
(``tests/test_graph.py`` compares them with the stage's entry in ``dvc.yaml``).

A bad input (params, a missing or corrupt artifact) or a full/failing disk ends the stage
with one line, ``error: <message>``, on stderr and exit status 2, and so does the GPU running
out of memory (the line names the params that size the stage's batches); Ctrl-C ends it with
one line and exit status 130; ``CED_CSA2_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import yaml
from tqdm.contrib.logging import logging_redirect_tqdm

from ..config import load_params, record_reads
from .atomic_files import DISK_ERRNOS, atomic_write_text
from .cli import ArgumentParser
from .paths import timings_path

RECORD_ENV = "CED_CSA2_RECORD_READS"
DEBUG_ENV = "CED_CSA2_DEBUG"  # =1: re-raise an input error (or Ctrl-C) with its traceback instead of one line
INTERRUPTED = 130  # the exit status of a stage ended by Ctrl-C (SIGINT), as a shell reports 128 + 2
# Input errors: a stage that raises one of these exits 2 with one line on stderr, no traceback.
# ParamsError, PlanError, CheckpointError and DumpError are ValueErrors; AssetError (a
# RuntimeError) is matched by name, so that this module imports none of them (every stage's
# dvc.yaml deps are its import closure: see tests/test_graph.py).
INPUT_ERRORS = (ValueError, FileNotFoundError)
INPUT_ERROR_NAMES = {("ced_csa2.assets", "AssetError")}
# The GPU running out of memory is the machine too: matched by name, as AssetError is (this module
# imports no torch); torch.cuda.OutOfMemoryError is the same class.
OUT_OF_MEMORY = ("torch", "OutOfMemoryError")
# What sizes the work a stage holds on the GPU at once, by stage (a foreach stage by its base name):
# the params its out-of-memory line tells the user to lower.
BATCH_PARAMS = {
    "dump": ("dump.batch_size",),
    "ridge": ("ridge.block_rows",),
    "train_projector": ("train_projector.batch_size",),
    "extra_projectors": ("train_projector.batch_size",),
    "train_adapters": ("train_adapters.batch_size",),
    "tune": ("train.online.batch_size", "train.online.seq_len"),
    "tune_mode_a": ("train.online.batch_size", "train.online.seq_len"),
    "eval_ppl": ("eval_ppl.batch_size",),
    "eval_generation": ("eval_generation.batch_size",),
    "eval_retrieval": ("eval_retrieval.batch_size",),
    "eval_gsm8k": ("eval_gsm8k.batch_size",),
    "eval_objectives": ("eval_gsm8k.batch_size",),
}
# Files under these folders are pipeline artifacts: a stage that reads one must declare it.
ARTIFACT_DIRS = ("data", "models", "metrics", "reports")
PIPELINE = Path("dvc.yaml")  # the stage table a stage's position is counted in (the cwd is the repository root)
log = logging.getLogger(__name__)
_FILES_READ: set[str] | None = None
_TIMINGS: dict = {}


def record_timing(**items) -> None:
    """Add wall times or speed ratios to what this stage writes to ``timings/<stage>.json`` when it ends.

    Timings never go into a stage's metrics: they differ between runs and machines, and a
    rerun on the same inputs must rewrite its results (and ``dvc.lock``) byte for byte.
    """
    _TIMINGS.update(items)


def recorded_timings() -> dict:
    """What :func:`record_timing` holds so far in this process (a copy)."""
    return dict(_TIMINGS)


def _audit(event: str, args: tuple) -> None:
    # sys.audit's "open" fires for every Python-level open (builtins, io, pathlib, torch.load);
    # h5py opens through the HDF5 C library, so dump_file raises "ced_csa2.read" itself.
    if _FILES_READ is None or event not in ("open", "ced_csa2.read"):
        return
    path, mode, flags = (args + (None, None))[:3]
    if isinstance(path, int):
        return
    writing = (mode is not None and any(c in str(mode) for c in "wax")) or (
        mode is None and flags is not None and flags & (os.O_WRONLY | os.O_RDWR))
    if writing:
        return
    try:
        rel = Path(os.fsdecode(path)).resolve().relative_to(Path.cwd().resolve())
    except ValueError:  # outside the repository (asset cache, site-packages)
        return
    if rel.parts and rel.parts[0] in ARTIFACT_DIRS:
        _FILES_READ.add(rel.as_posix())


def _module(run) -> str:
    """``ced_csa2.stages.<stage>``, the module ``run`` belongs to."""
    module = run.__module__
    if module == "__main__":  # python -m ced_csa2.stages.<stage>
        module = sys.modules["__main__"].__spec__.name
    return module


def stage_name(run, args: tuple) -> str:
    """``tune@distill`` for ``ced_csa2.stages.tune.run`` with argument ``distill``."""
    name = _module(run).rsplit(".", 1)[-1]
    return f"{name}@{args[0]}" if args else name


def stage_position(name: str, pipeline: Path = PIPELINE) -> str:
    """``" (7 of 19 in dvc.yaml)"``: where stage ``name`` (``tune@distill``: ``tune``) stands in ``pipeline``.

    ``""`` when there is no readable ``pipeline`` or the stage is not in it (a test's temp folder, a study).
    """
    try:
        stages = list(yaml.safe_load(pipeline.read_text(encoding="utf-8"))["stages"])
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return ""
    base = name.split("@")[0]
    return f" ({stages.index(base) + 1} of {len(stages)} in {pipeline})" if base in stages else ""


def is_input_error(exc: BaseException) -> bool:
    """A bad input or a missing/corrupt artifact (one line, exit 2), not a bug (traceback)."""
    return isinstance(exc, INPUT_ERRORS) or (isinstance(exc, OSError) and exc.errno in DISK_ERRNOS) or any(
        (cls.__module__, cls.__qualname__) in INPUT_ERROR_NAMES for cls in type(exc).__mro__)


def is_out_of_memory(exc: BaseException) -> bool:
    """``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``): the GPU, not a bug."""
    return any((cls.__module__, cls.__qualname__) == OUT_OF_MEMORY for cls in type(exc).__mro__)


def out_of_memory_line(stage: str, exc: BaseException) -> str:
    """``error: <stage>: the GPU ran out of memory (...): lower <params> ...`` on one line.

    ``stage`` is a stage's name (``tune@attn_out``) or a study's (``training_mix``).  Only torch's first two sentences are kept ("CUDA out of memory. Tried to allocate 2.00
    GiB"): the rest is an allocator report of many lines.
    """
    what = ". ".join(" ".join(str(exc).split()).split(". ")[:2]).rstrip(".") or type(exc).__name__
    keys = BATCH_PARAMS.get(stage.split("@")[0])
    remedy = (f"lower {' or '.join(keys)} in params.yaml and run it again" if keys else
              "free the GPU's memory (another process may hold it) or use a GPU with more")
    return (f"error: {stage}: the GPU ran out of memory ({what}): {remedy}; every output is its complete old "
            "file (none is left half-written)")


def error_line(exc: BaseException) -> str:
    """``error: <message>`` on one line (a multi-line message is joined)."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    return f"error: {message}"


def run_stage(run, *args, launcher=None) -> None:
    """Entry point of a stage module: log to stderr, then ``run(load_params(), *args)`` from the cwd.

    An input error (:func:`is_input_error`) prints ``error: <message>`` to stderr and exits
    with status 2, the GPU out of memory :func:`out_of_memory_line` and status 2, Ctrl-C
    (``KeyboardInterrupt``) one line and status 130; with
    ``CED_CSA2_DEBUG=1`` either propagates with its traceback instead.  Any other exception
    keeps its traceback.

    ``launcher(params, module, args)`` (a data-parallel stage's
    :func:`ced_csa2.pipeline.distributed.relaunch`) may run the stage in other processes and return
    their exit status, which this process then exits with; ``None`` runs it here.  A stage
    without one refuses to run as one of several processes (``WORLD_SIZE > 1``: ``torchrun``),
    which would be copies writing the same outputs.
    """
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        _run_stage(run, *args, launcher=launcher)
    except KeyboardInterrupt:
        if debug:
            raise
        # Not a bug: no traceback.  What the runner knows of every stage: outputs are written
        # to a temp file and renamed whole (atomic_files), and an interrupted write removes its temp.
        _flush_log()
        print(f"{stage_name(run, args)}: interrupted; every output is its complete old or new file (none is left "
              "half-written): run the stage again to finish", file=sys.stderr, flush=True)
        raise SystemExit(INTERRUPTED) from None
    except Exception as exc:
        out_of_memory = is_out_of_memory(exc)
        if not (out_of_memory or is_input_error(exc)) or debug:
            raise
        _flush_log()
        print(out_of_memory_line(stage_name(run, args), exc) if out_of_memory else error_line(exc), file=sys.stderr,
              flush=True)
        raise SystemExit(2) from None


def _flush_log() -> None:
    for handler in logging.getLogger().handlers:  # what the stage logged comes before the runner's last line
        handler.flush()


def _run_stage(run, *args, launcher=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    name = stage_name(run, args)
    # Log lines written while a tqdm bar is open go above the bar, not glued into it.
    # Progress on stdout, beside DVC's own "Running stage": stderr keeps a fault to its one line.
    print(f"stage {name}{stage_position(name)}", flush=True)
    with logging_redirect_tqdm():
        _run_logged(run, name, t0, *args, launcher=launcher)
        log.info("stage %s done in %.1f s", name, time.perf_counter() - t0)


def _run_logged(run, name: str, t0: float, *args, launcher=None) -> None:
    global _FILES_READ

    if launcher is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(f"stage {name} is not data-parallel: run it as one process (python -m "
                         f"ced_csa2.stages.{name.split('@')[0]}), not under torchrun")
    # Every process of a data-parallel run records the same reads: only rank 0 writes them down.
    main_rank = os.environ.get("RANK", "0") == "0"
    record_dir = os.environ.get(RECORD_ENV) if main_rank else None
    params = load_params()
    if launcher is not None:
        status = launcher(params, _module(run), [str(a) for a in args])
        if status is not None:
            if status:
                raise SystemExit(status)
            return
    if not record_dir:
        run(params, *args)
    else:
        _FILES_READ = set()
        sys.addaudithook(_audit)
        with record_reads() as keys:
            run(params, *args)
        _write(Path(record_dir) / f"{name}.json",
               {"params": sorted(keys), "files": sorted(_FILES_READ)})
    if main_rank:  # wall time of the stage (its module imports before run_stage not included), peak RSS
        _write(timings_path(name), {
            **_TIMINGS, "wall_s": round(time.perf_counter() - t0, 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)})


def _write(path: Path, obj: dict) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def stage_arguments(run, argv: Sequence[str] | None, *names: str) -> list[str]:
    """The values of ``python -m ced_csa2.stages.<stage> [<name> ...]``'s arguments, in the order of ``names``.

    ``argv`` (``None``: the command line's) holds exactly those (a foreach stage's ``${item}``, e.g. an
    objective): anything else is the usage and one error line, exit status 2, before any work.
    """
    stage = _module(run).rsplit(".", 1)[-1]
    parser = ArgumentParser(prog=f"python -m ced_csa2.stages.{stage}",
                            description=f"dvc.yaml's stage {stage}: params.yaml and its inputs from the working "
                                        "directory")
    for name in names:
        parser.add_argument(name)
    args = parser.parse_args(argv)
    return [getattr(args, name) for name in names]
