"""Confidence intervals for the figures the pipeline reports.

* :func:`paired_bootstrap` -- 95% interval of a change between two groups scored on the
  same records (ΔPPL %, Δ NLL/token), resampling *records* (the unit the corpus is made
  of; tokens inside a record are not independent) with the same draw for both groups.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

# Statistics of a resample from the summed NLL and token count of group and baseline.
DELTAS: dict[str, Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]] = {
    # 100 * (PPL_group / PPL_base - 1), corpus-level PPL = exp(sum NLL / sum tokens)
    "delta_ppl_pct": lambda g, b, n: 100.0 * np.expm1((g - b) / n),
    # NLL per token, group minus baseline (nats)
    "delta_nll": lambda g, b, n: (g - b) / n,
}


def paired_bootstrap(group: np.ndarray, base: np.ndarray, statistic: str = "delta_ppl_pct", *,
                     n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """Point estimate and percentile interval of a paired change over records.

    Parameters
    ----------
    group, base : np.ndarray, shape (R, 2)
        Per record: summed NLL (nats) and scored tokens, for the group and the baseline
        on the *same* records (the token counts must agree).
    statistic
        A key of :data:`DELTAS`.
    n_boot, seed, level
        Number of resamples, their seed, and the interval's coverage.

    Returns
    -------
    dict
        ``{"value", "ci95": [low, high], "n_records", "n_boot"}``; ``value`` is the
        statistic on all records (not a bootstrap mean).
    """
    group, base = np.asarray(group, dtype=np.float64), np.asarray(base, dtype=np.float64)
    if group.shape != base.shape or group.ndim != 2 or group.shape[1] != 2 or len(group) == 0:
        raise ValueError(f"paired_bootstrap needs two (R, 2) arrays of the same R > 0, got {group.shape}, {base.shape}")
    if not np.array_equal(group[:, 1], base[:, 1]):
        raise ValueError("paired_bootstrap: group and baseline were scored on different tokens")
    fn = DELTAS[statistic]
    idx = np.random.default_rng(seed).integers(0, len(group), size=(n_boot, len(group)))
    draws = fn(group[idx, 0].sum(1), base[idx, 0].sum(1), base[idx, 1].sum(1))
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(draws, [tail, 100 - tail])
    value = fn(group[:, 0].sum(), base[:, 0].sum(), base[:, 1].sum())
    return {"value": float(value), "ci95": [float(low), float(high)], "n_records": len(group), "n_boot": n_boot}


def paired_deltas(nll: dict, statistic: str, seed: int, base: str = "baseline") -> dict[str, dict]:
    """:func:`paired_bootstrap` of every group of ``nll`` (``{group: (R, 2)}``) against ``base``.

    Empty when ``base`` was not scored; ``base`` itself is left out.
    """
    if base not in nll:
        return {}
    return {g: paired_bootstrap(v, nll[base], statistic, seed=seed) for g, v in nll.items() if g != base}
