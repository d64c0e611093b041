"""Data parallelism on ``torch.distributed``: one process per device, ``distributed.nproc`` of them.

A data-parallel stage (``dump``, ``ridge``, ``train_projector``, ``train_adapters``,
``eval_ppl``, ``eval_gsm8k``) started as ``python -m ced_csa2.stages.<stage>`` with
``distributed.nproc: N > 1`` re-executes itself under ``torchrun --standalone --nproc-per-node N``
(:func:`relaunch`, called by :func:`ced_csa2.pipeline.stage_runner.run_stage`), so ``dvc.yaml``'s
``cmd:`` is the same for any ``N``.  Inside, :func:`session` opens the process group
(``backend: auto``: NCCL on CUDA, gloo on CPU) and closes it; every rank runs the
stage on its share of the work and only :func:`is_main` writes shared outputs.  With
``nproc: 1`` no process group exists and every helper here is the identity:
:func:`world_size` is 1, :func:`bounds` is everything, the reductions do nothing.

Sharding is contiguous (:func:`bounds`): rank ``r`` of ``W`` takes items
``[n r // W, n (r + 1) // W)``, so the ranks' parts, concatenated in rank order, are
the single-process order.  Stages shard whole batches (the single-process batches,
unchanged), so a rank computes exactly what one process computes for those batches.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from typing import Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist

from ..config import DistributedConfig

T = TypeVar("T")
# Set by torchrun in every process it starts.
WORLD_ENV, RANK_ENV, LOCAL_RANK_ENV = "WORLD_SIZE", "RANK", "LOCAL_RANK"


def launched_world() -> int:
    """Processes torchrun started (``WORLD_SIZE``), 1 outside torchrun."""
    return int(os.environ.get(WORLD_ENV, "1"))


def relaunch(params, module: str, args: Sequence[str]) -> int | None:
    """Re-execute ``python -m module args`` under torchrun when ``distributed.nproc > 1``.

    Returns torchrun's exit status, or ``None`` when this process is to run the stage
    itself (``nproc: 1``, or already one of torchrun's processes).  Killed, even by
    SIGKILL, this process takes torchrun and its workers with it (:func:`_die_with_parent`),
    so a rerun never meets an orphaned worker still writing its shard.
    """
    nproc = object.__getattribute__(params.distributed, "nproc")  # a launch, not a read: session() records it
    if nproc == 1 or WORLD_ENV in os.environ:
        return None
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", module, *args]
    parent = os.getpid()
    die_with_parent = (lambda: _die_with_parent(parent)) if sys.platform == "linux" else None
    return subprocess.run(cmd, preexec_fn=die_with_parent).returncode


def _die_with_parent(parent: int) -> None:
    """In the child, before exec (Linux): SIGTERM when the parent ``parent`` dies, however it dies.

    torchrun stops its workers on SIGTERM; a SIGKILL of the parent cannot be forwarded by
    the parent itself, so the kernel does it (``prctl(PR_SET_PDEATHSIG)``).
    """
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the prctl: no signal will come
        os._exit(1)


def _backend(cfg: DistributedConfig) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


@contextlib.contextmanager
def session(cfg: DistributedConfig) -> Iterator[None]:
    """The process group of a data-parallel stage, for the block (nothing when ``nproc`` is 1).

    Raises
    ------
    ValueError
        When the processes torchrun started are not ``cfg.nproc`` (a stage run by hand
        under ``torchrun`` with another count).
    """
    nproc, backend = cfg.nproc, _backend(cfg)
    if launched_world() != nproc:
        raise ValueError(f"params key 'distributed.nproc' is {nproc} but this stage runs in {launched_world()} "
                         f"process(es) (run it as `python -m ced_csa2.stages.<stage>`: it starts torchrun itself)")
    if nproc == 1:
        yield
        return
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ[LOCAL_RANK_ENV]))
    dist.init_process_group(backend)
    try:
        yield
    finally:
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    """Whether this process writes the shared outputs (rank 0; the only process without a group)."""
    return rank() == 0


def local_device(device: torch.device) -> torch.device:
    """``device`` for this rank: ``cuda:LOCAL_RANK`` for a CUDA device under a process group (one device per rank)."""
    if device.type == "cuda" and dist.is_initialized():
        return torch.device("cuda", int(os.environ[LOCAL_RANK_ENV]))
    return device


def bounds(n: int, r: int | None = None, world: int | None = None) -> tuple[int, int]:
    """Rank ``r``'s (default: this rank's) contiguous share ``[lo, hi)`` of ``n`` items."""
    r, world = rank() if r is None else r, world_size() if world is None else world
    return n * r // world, n * (r + 1) // world


def shard(items: Sequence[T]) -> Sequence[T]:
    """This rank's contiguous slice of ``items`` (:func:`bounds`); all of them without a process group."""
    lo, hi = bounds(len(items))
    return items[lo:hi]


def batch_bounds(n: int, batch_size: int) -> tuple[int, int]:
    """This rank's items ``[lo, hi)`` when ``n`` items in batches of ``batch_size`` are sharded by whole batch."""
    lo, hi = bounds(-(-n // batch_size))
    return min(n, lo * batch_size), min(n, hi * batch_size)


def _device_for_collectives(t: torch.Tensor) -> torch.device:
    # NCCL reduces CUDA tensors only; gloo reduces CPU ones.
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_sum(*tensors: torch.Tensor) -> None:
    """Sum each tensor over the ranks, in place (float64 sums stay float64); nothing without a group."""
    if not dist.is_initialized():
        return
    for t in tensors:
        where = _device_for_collectives(t)
        buf = t.to(where)
        dist.all_reduce(buf)
        if buf is not t:
            t.copy_(buf)


def assemble(part: torch.Tensor, lo: int, n: int) -> torch.Tensor:
    """Rows ``[lo, lo + len(part))`` from each rank, as one ``(n, ...)`` tensor on every rank.

    Each rank fills its rows of a zero tensor and the ranks sum them: exact, since every
    other entry a rank adds is zero.
    """
    full = torch.zeros((n, *part.shape[1:]), dtype=part.dtype)
    full[lo:lo + len(part)] = part.cpu()
    all_reduce_sum(full)
    return full


def gather(obj: T) -> list[T]:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` without a group."""
    if not dist.is_initialized():
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
