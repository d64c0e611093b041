"""Paired wall-clock timing: arms compared on one shape, warmed up, alternated, medians.

Protocol (:func:`paired_seconds`).  For one input shape:

1. one untimed call of every arm (kernel selection, oneDNN/AMX primitive creation, CUDA
   context and allocator growth are paid per shape, and whichever arm ran first on a new
   shape would otherwise carry them);
2. ``repeats`` (>= 3) rounds, each calling every arm once, the order rotated by one arm
   per round (two arms: AB, BA, AB, ...), so that no arm always runs first or last
   (caches, frequency boost and a neighbour's load drift over time);
3. each arm's median over the rounds (robust to one preempted run).

Every clock reading first waits for the work queued on the timed device
(``torch.cuda.synchronize`` on CUDA, where a reading right after a call measures the
launch; a no-op on a CPU).

A ratio that work counting bounds (fewer layers run, fewer FLOPs) is checked against
the bound with :func:`check_bound`: a measured speed-up above what is possible means the
measurement is wrong (an unpaid warm-up, an unsynchronised clock), so it is refused
rather than reported.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

MIN_REPEATS = 3

PROTOCOL = ("per shape: one untimed warm-up call of each arm, then {repeats} rounds calling every arm once, "
            "the order rotated each round (AB, BA, ...), device synchronised at each clock reading; "
            "per-arm median over the rounds")


class Clock:
    """Wall-clock seconds on ``device``; each reading waits until the device has finished its queued work.

    Parameters
    ----------
    device
        The device the timed work runs on (``"cpu"``: no wait).
    """

    def __init__(self, device: str | torch.device = "cpu"):
        device = torch.device(device)
        self._sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def __call__(self) -> float:
        self._sync()
        return time.perf_counter()


class BoundExceeded(RuntimeError):
    """A measured speed-up above the most the work saved allows."""


@dataclass(frozen=True)
class Paired:
    """Result of :func:`paired_seconds`.

    Attributes
    ----------
    seconds
        ``{arm: median seconds}`` over the timed rounds.
    runs
        ``{arm: [seconds of round 0, 1, ...]}`` (length ``repeats``).
    order
        The arms in the order they were called, warm-up excluded (``repeats * len(arms)``).
    repeats
        Timed rounds.
    """

    seconds: dict[str, float]
    runs: dict[str, list[float]]
    order: list[str]
    repeats: int

    def ratio(self, slow: str, fast: str) -> float:
        """``seconds[slow] / seconds[fast]`` (> 1: ``fast`` is faster)."""
        return self.seconds[slow] / self.seconds[fast]

    @property
    def protocol(self) -> str:
        return PROTOCOL.format(repeats=self.repeats)


def paired_seconds(arms: Mapping[str, Callable[[], object]], repeats: int = MIN_REPEATS, *, warmup: bool = True,
                   device: str | torch.device = "cpu", setup: Callable[[], object] | None = None,
                   self_timed: bool = False) -> Paired:
    """Median wall seconds of each arm on one shape, the arms warmed up and alternated.

    Parameters
    ----------
    arms
        ``{name: fn}``, two or more zero-argument callables doing the same job on the same
        input (their results are discarded unless ``self_timed``).
    repeats
        Timed rounds, at least :data:`MIN_REPEATS`.
    warmup
        Make the untimed call of every arm first.  ``False`` only when the caller has just
        called every arm on this shape itself (e.g. the scoring call whose result it keeps).
    device
        Device the arms run on; every clock reading synchronises it.
    setup
        Called untimed before every call of an arm, warm-up included (e.g. dropping the
        page cache, so that every read is cold).
    self_timed
        Each arm returns its own seconds, which are used instead of the wall time around
        the call (work timed inside a subprocess, its start-up left out).

    Returns
    -------
    Paired
        Per-arm medians, the raw rounds and the call order.
    """
    if len(arms) < 2:
        raise ValueError(f"paired timing needs two or more arms, got {list(arms)}")
    return _rounds(arms, repeats, warmup, device, setup, self_timed)


def median_seconds(fn: Callable[[], object], repeats: int = MIN_REPEATS, *, warmup: bool = True,
                   device: str | torch.device = "cpu", setup: Callable[[], object] | None = None) -> float:
    """Median wall seconds of ``repeats`` calls of ``fn`` after one untimed call: a figure compared with none.

    Parameters as for :func:`paired_seconds`.  A ratio of two such figures is not paired
    (load drifts between them): time the two through :func:`paired_seconds`.
    """
    return _rounds({"fn": fn}, repeats, warmup, device, setup, False).seconds["fn"]


def _rounds(arms, repeats, warmup, device, setup, self_timed) -> Paired:
    if repeats < MIN_REPEATS:
        raise ValueError(f"paired timing needs repeats >= {MIN_REPEATS} (a median of fewer is not robust), got {repeats}")
    clock, names = Clock(device), list(arms)
    setup = setup or (lambda: None)
    if warmup:
        for name in names:
            setup()
            arms[name]()
            clock()  # the warm-up's queued work must not spill into the first timed call
    runs: dict[str, list[float]] = {name: [] for name in names}
    order = []
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            setup()
            t0 = clock()
            out = arms[name]()
            wall = clock() - t0
            runs[name].append(float(out) if self_timed else wall)
            order.append(name)
    return Paired({n: statistics.median(v) for n, v in runs.items()}, runs, order, repeats)


def check_bound(ratio: float, bound: float, what: str, seconds: Mapping[str, float]) -> float:
    """``ratio`` if it does not exceed ``bound``; else :class:`BoundExceeded` naming both and the arm timings.

    Parameters
    ----------
    ratio
        Measured speed-up (slow arm seconds / fast arm seconds).
    bound
        The most the saved work allows (e.g. layers run by the slow arm / by the fast one).
    what
        What the ratio is, for the message.
    seconds
        ``{arm: seconds}`` the ratio came from, for the message.
    """
    if ratio > bound:
        arms = ", ".join(f"{k} {v:.4g} s" for k, v in seconds.items())
        raise BoundExceeded(f"{what}: measured {ratio:.3f}x exceeds its bound {bound:.3f}x ({arms}); "
                            "the timing is wrong (warm-up paid by one arm, or an unsynchronised clock)")
    return ratio
