"""The shared progress bar: its ETA ignores the first step's warm-up, so a step of minutes never reads as hours."""

import io
import re

import pytest
from tqdm import tqdm

from ced_csa2.pipeline.progress import Progress

TOTAL, FIRST_S, STEP_S = 100, 60.0, 1.0  # a minute of warm-up, then a second a step


class Clock:
    """tqdm's clock, advanced by the test: the timings are exact, whatever the machine's load."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def seconds(interval: str) -> int:
    """tqdm's ``[h:]mm:ss`` as seconds."""
    return sum(int(part) * 60 ** k for k, part in enumerate(reversed(interval.split(":"))))


def shown_etas(bar_class, clock: Clock, iterate: bool) -> list[tuple[int, str]]:
    """``(n, ETA)`` of every line a ``bar_class`` bar draws over TOTAL steps, the first FIRST_S long, the rest STEP_S."""
    out = io.StringIO()
    bar = bar_class(range(TOTAL) if iterate else None, total=TOTAL, file=out, mininterval=0, ascii=True)
    if iterate:
        for i in bar:
            clock.now += FIRST_S if i == 0 else STEP_S
    else:
        for i in range(TOTAL):
            clock.now += FIRST_S if i == 0 else STEP_S
            bar.update()
        bar.close()
    return [(int(n), eta) for n, eta in re.findall(r"(\d+)/\d+ \[[\d:]+<([\d:?]+),", out.getvalue())]


@pytest.mark.parametrize("iterate", [False, True], ids=["update", "iterate"])
def test_no_eta_exceeds_the_remaining_steps_at_the_later_steps_pace(monkeypatch, iterate):
    clock = Clock()
    monkeypatch.setattr("tqdm.std.time", clock)
    etas = [(n, eta) for n, eta in shown_etas(Progress, clock, iterate) if n > 0]
    assert etas[0] == (1, "?")  # the first step's line: no step after the warm-up timed yet
    assert {n for n, _ in etas} == set(range(1, TOTAL + 1))
    assert all(seconds(eta) <= (TOTAL - n) * STEP_S for n, eta in etas[1:]), etas
    assert etas[-1] == (TOTAL, "00:00")

    plain = [(n, eta) for n, eta in shown_etas(tqdm, clock, iterate) if n == 1]
    assert seconds(plain[0][1]) == (TOTAL - 1) * FIRST_S  # tqdm's own: 1:39:00 for 99 seconds of work


def test_a_disabled_bar_passes_its_items_through():
    assert list(Progress(range(3), disable=True)) == [0, 1, 2]
