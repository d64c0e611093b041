"""The paired timing protocol (warm-up, alternation, median), the bound check, and Mode A's timing apart from its quality."""

import pytest
import torch
from conftest import tiny_llama
from tiny_maps import (
    random_parts,
)

from ced_csa2.eval import perplexity
from ced_csa2.model_utils import geometry
from ced_csa2.pipeline import timing
from ced_csa2.pipeline.timing import BoundExceeded, Paired, check_bound, paired_seconds
from ced_csa2.plan import LayerPlan


@pytest.fixture
def fake_clock(monkeypatch):
    """A clock that only the fake arms advance: ``(log, arm)``; ``arm(name, durations)`` takes its durations in turn."""
    now, log = [0.0], []
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def arm(name, durations):
        it = iter(durations)

        def call():
            log.append(name)
            now[0] += next(it)
        return call
    return log, arm


def test_warm_up_then_alternated_rounds_and_the_median(fake_clock):
    log, arm = fake_clock
    # first value: the warm-up (a huge per-shape cost that must not reach the figure);
    # then the rounds: one outlier each, which the median ignores
    a = arm("a", [100.0, 2.0, 9.0, 3.0, 2.5, 2.0])
    b = arm("b", [50.0, 1.0, 1.5, 0.5, 30.0, 1.0])
    t = paired_seconds({"a": a, "b": b}, repeats=5)
    assert log == ["a", "b"] + ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    assert t.order == log[2:] and t.repeats == 5
    assert t.runs == {"a": [2.0, 9.0, 3.0, 2.5, 2.0], "b": [1.0, 1.5, 0.5, 30.0, 1.0]}
    assert t.seconds == {"a": 2.5, "b": 1.0} and t.ratio("a", "b") == 2.5
    assert "warm-up" in t.protocol and "median" in t.protocol and "5 rounds" in t.protocol


def test_three_arms_rotate_and_warmup_can_be_skipped(fake_clock):
    log, arm = fake_clock
    arms = {n: arm(n, [1.0] * 3) for n in "xyz"}
    paired_seconds(arms, repeats=3, warmup=False)
    assert log == list("xyz" "yzx" "zxy")  # every arm once first, once in the middle, once last


def test_too_few_repeats_or_arms_are_refused(fake_clock):
    _, arm = fake_clock
    with pytest.raises(ValueError, match="repeats >= 3"):
        paired_seconds({"a": arm("a", [1.0] * 9), "b": arm("b", [1.0] * 9)}, repeats=2)
    with pytest.raises(ValueError, match="two or more arms"):
        paired_seconds({"a": arm("a", [1.0] * 9)})


def test_a_ratio_above_its_bound_raises_naming_ratio_bound_and_timings():
    assert check_bound(1.9, 2.0, "skip", {"plain": 1.9, "mode_a": 1.0}) == 1.9
    assert check_bound(2.0, 2.0, "skip", {"plain": 2.0, "mode_a": 1.0}) == 2.0
    with pytest.raises(BoundExceeded, match=r"skip: measured 4\.620x exceeds its bound 2\.000x "
                                            r"\(plain 4\.62 s, mode_a 1 s\)"):
        check_bound(4.62, 2.0, "skip", {"plain": 4.62, "mode_a": 1.0})


PLAN = LayerPlan(2, 3, (5, 6), (4,))  # covering on tiny_llama's 6 layers: bound 6 / 2


@pytest.fixture(scope="module")
def llama_mode_a():
    model = tiny_llama()
    geo = geometry(model.config)
    plan = PLAN.validate(geo)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (12, 20, 17, 25, 9)]
    return model, plan, geo, random_parts(geo, plan), ids


def quality(out: dict) -> dict:
    return {k: v for k, v in out.items() if k != "timing"}


def test_mode_a_quality_is_the_scoring_path_bit_for_bit_whatever_is_timed(llama_mode_a, monkeypatch):
    model, plan, geo, parts, ids = llama_mode_a
    every = perplexity.mode_a_prefix(model, plan, geo, parts, ids, 0.5, seed=0, timing_records=0)
    two = perplexity.mode_a_prefix(model, plan, geo, parts, ids, 0.5, seed=0, timing_records=2)
    calls = []
    # the scoring path alone: nothing timed
    monkeypatch.setattr(perplexity, "paired_seconds", lambda *a, **k: calls.append(1) or Paired(
        {"plain": 1.0, "mode_a": 1.0}, {}, [], 3))
    untimed = perplexity.mode_a_prefix(model, plan, geo, parts, ids, 0.5, seed=0, timing_records=0)
    assert len(calls) == len(ids)
    assert quality(every) == quality(two) == quality(untimed)
    assert not {"prefill_seconds", "prefill_speedup"} & set(quality(every))
    assert every["covered"] and every["records"] == len(ids) and every["mode_a"]["ppl"] != every["baseline"]["ppl"]

    t = two["timing"]
    assert {"records", "repeats", "plain_s", "mode_a_s", "speedup", "bound", "protocol"} <= set(t)
    assert t["records"] == 2 and t["repeats"] == 3 and t["bound"] == 3.0
    assert t["plain_s"] > 0 and t["mode_a_s"] > 0 and "warm-up" in t["protocol"] and "median" in t["protocol"]
    # Millisecond arms on a loaded machine may time above the bound: then refused, never reported.
    if t["speedup"] is None:
        assert "exceeds its bound" in t["refused"] and t["plain_s"] / t["mode_a_s"] > t["bound"]
    else:
        assert t["speedup"] == pytest.approx(t["plain_s"] / t["mode_a_s"]) and 0 < t["speedup"] <= t["bound"]
    assert every["timing"]["records"] == len(ids)


def test_mode_a_speedup_above_the_layer_bound_is_refused_not_reported(llama_mode_a, monkeypatch):
    model, plan, geo, parts, ids = llama_mode_a
    monkeypatch.setattr(perplexity, "paired_seconds", lambda *a, **k: Paired({"plain": 4.62, "mode_a": 1.0}, {}, [], 3))
    out = perplexity.mode_a_prefix(model, plan, geo, parts, ids, 0.5, seed=0, timing_records=1)
    assert out["timing"]["speedup"] is None
    assert "measured 4.620x exceeds its bound 3.000x" in out["timing"]["refused"]
    assert out["covered"] and out["mode_a"]["tokens"] > 0  # the quality figures stand


def test_setup_runs_untimed_before_every_call_and_self_timed_arms_report_their_own(fake_clock):
    log, arm = fake_clock
    setups = []
    a, b = arm("a", [7.0] * 4), arm("b", [7.0] * 4)
    t = paired_seconds({"a": lambda: a() or 1.0, "b": lambda: b() or 3.0}, setup=lambda: setups.append(len(log)),
                       self_timed=True)
    assert setups == list(range(8)) and t.seconds == {"a": 1.0, "b": 3.0}  # the arms' own figures, not 7 s
    assert timing.median_seconds(arm("c", [5.0, 1.0, 2.0, 9.0])) == 2.0
