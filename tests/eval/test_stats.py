"""Paired bootstrap intervals: the point value is the exact change, the draw is paired and seeded."""

import numpy as np
import pytest

from ced_csa2.eval.stats import paired_bootstrap, paired_deltas


def records(rng, n, shift=0.0):
    tokens = rng.integers(50, 500, size=n).astype(float)
    return np.stack([tokens * (3.0 + shift + rng.normal(0, 0.2, n)), tokens], axis=1)


def test_value_is_the_corpus_level_change_and_the_interval_covers_it():
    rng = np.random.default_rng(0)
    base = records(rng, 60)
    group = base.copy()
    group[:, 0] += group[:, 1] * rng.normal(0.05, 0.02, 60)  # +~5% PPL, record to record noise
    out = paired_bootstrap(group, base, "delta_ppl_pct", seed=1)
    ppl = lambda a: np.exp(a[:, 0].sum() / a[:, 1].sum())  # noqa: E731
    # float64 throughout (sums of 60 float64 values, exp): ~60 eps64 ≈ 1e-14 relative
    assert out["value"] == pytest.approx(100 * (ppl(group) / ppl(base) - 1), rel=1e-12)
    low, high = out["ci95"]
    assert low < out["value"] < high and low > 0  # a real +5% change is told apart from zero
    nll = paired_bootstrap(group, base, "delta_nll", seed=1)
    assert nll["value"] == pytest.approx((group[:, 0].sum() - base[:, 0].sum()) / base[:, 1].sum())


def test_pairing_removes_the_shared_record_difficulty():
    # Records differ wildly in difficulty, the group is uniformly 1% worse: paired -> tight interval.
    rng = np.random.default_rng(0)
    base = records(rng, 40)
    base[:, 0] *= rng.uniform(0.5, 2.0, 40)
    group = base.copy()
    group[:, 0] += 0.01 * group[:, 1]
    low, high = paired_bootstrap(group, base, "delta_nll", seed=0)["ci95"]
    # float64: every resample's delta is exactly 0.01 up to ~eps64 × 60 terms; an interval of width 0 to rounding (a
    # real spread would be >= 1e-4)
    assert high - low < 1e-9 and low == pytest.approx(0.01)


def test_seeded_and_shrinking_with_more_records():
    rng = np.random.default_rng(3)
    base, group = records(rng, 400), records(rng, 400, shift=0.05)
    group[:, 1] = base[:, 1]
    assert paired_bootstrap(group, base, seed=5) == paired_bootstrap(group, base, seed=5)
    width = [np.diff(paired_bootstrap(group[:n], base[:n], seed=5)["ci95"])[0] for n in (25, 400)]
    assert width[1] < width[0] / 2.5  # ~ 1/sqrt(n): 4x for 16x the records


def test_refuses_unpaired_inputs_and_skips_the_baseline():
    rng = np.random.default_rng(0)
    base = records(rng, 10)
    other = base.copy()
    other[0, 1] += 1
    with pytest.raises(ValueError, match="different tokens"):
        paired_bootstrap(other, base)
    with pytest.raises(ValueError, match=r"\(R, 2\)"):
        paired_bootstrap(base[:5], base)
    out = paired_deltas({"baseline": base, "ced": base}, "delta_nll", seed=0)
    assert list(out) == ["ced"] and out["ced"]["value"] == 0.0
    assert paired_deltas({"ced": base}, "delta_nll", seed=0) == {}
