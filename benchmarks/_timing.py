"""Shared timing helpers of the benchmark scripts (run as ``python benchmarks/<name>.py``).

CUDA runs kernels asynchronously: a clock read right after a call returns measures the
launch, not the work.  Every reading here first waits for the work queued on the timed
device (a no-op on a CPU), and :func:`best_seconds` makes one untimed call first (CUDA
context, kernel selection and allocator warm-up land there, not in the figure).
"""

from __future__ import annotations

import time

import torch


class Clock:
    """Wall-clock seconds on ``device``: each reading waits until the device has finished its queued work."""

    def __init__(self, device: str | torch.device = "cpu"):
        device = torch.device(device)
        self._sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def __call__(self) -> float:
        self._sync()
        return time.perf_counter()


def best_seconds(fn, repeats: int, *, warmup: bool = True, device: str | torch.device = "cpu") -> float:
    """Best wall time of ``repeats`` calls of ``fn`` running on ``device`` (after one untimed call when ``warmup``)."""
    clock = Clock(device)
    if warmup:
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best
