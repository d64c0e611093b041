"""Shared timing helper of the benchmark scripts (run as ``python benchmarks/<name>.py``)."""

from __future__ import annotations

import time


def best_seconds(fn, repeats: int, *, warmup: bool = True) -> float:
    """Best wall time of ``repeats`` calls of ``fn`` (after one untimed call when ``warmup``)."""
    if warmup:
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
