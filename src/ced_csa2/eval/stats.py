"""Confidence intervals for the figures the pipeline reports.

* :func:`paired_bootstrap` -- 95% interval of a change between two groups scored on the
  same records (ΔPPL %, Δ NLL/token), resampling *records* (the unit the corpus is made
  of; tokens inside a record are not independent) with the same draw for both groups.
* :func:`ratio_bootstrap` -- 95% interval of a per-token mean over records (KL to the
  baseline, top-1 agreement): the same resampling, so with the same seed the same
  records are drawn as for the Δs.
* :func:`bootstrap` -- both above: the value and percentile interval of any statistic of
  record resamples (a median's, ``eval.generation.median_ci``).
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
    return bootstrap(lambda idx: fn(group[idx, 0].sum(-1), base[idx, 0].sum(-1), base[idx, 1].sum(-1)),
                      len(group), n_boot, seed, level)


def ratio_bootstrap(num: np.ndarray, den: np.ndarray, *, scale: float = 1.0, n_boot: int = 2000, seed: int = 0,
                    level: float = 0.95) -> dict:
    """``scale * sum(num) / sum(den)`` over records and its percentile interval.

    Parameters
    ----------
    num, den : np.ndarray, shape (R,)
        Per record: a summed per-token quantity (KL nats, agreeing tokens) and its token count.
    scale
        Multiplier of the ratio (100 for a percentage).
    n_boot, seed, level
        As for :func:`paired_bootstrap` (the same seed draws the same records).

    Returns
    -------
    dict
        ``{"value", "ci95": [low, high], "n_records", "n_boot"}``.
    """
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    if num.shape != den.shape or num.ndim != 1 or len(num) == 0 or den.sum() <= 0:
        raise ValueError(f"ratio_bootstrap needs two (R,) arrays of the same R > 0 with tokens, got {num.shape}, "
                         f"{den.shape}")
    return bootstrap(lambda idx: scale * num[idx].sum(-1) / den[idx].sum(-1), len(num), n_boot, seed, level)


def bootstrap(statistic: Callable[[np.ndarray], np.ndarray], n_records: int, n_boot: int, seed: int,
               level: float) -> dict:
    """Value on all records and percentile interval over ``n_boot`` record resamples.

    ``statistic`` maps an ``(m, R)`` array of record indices to ``m`` values (``m`` resamples).
    """
    idx = np.random.default_rng(seed).integers(0, n_records, size=(n_boot, n_records))
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(statistic(idx), [tail, 100 - tail])
    value = statistic(np.arange(n_records)[None])[0]
    return {"value": float(value), "ci95": [float(low), float(high)], "n_records": n_records, "n_boot": n_boot}

def paired_deltas(nll: dict, statistic: str, seed: int, base: str = "baseline") -> dict[str, dict]:
    """:func:`paired_bootstrap` of every group of ``nll`` (``{group: (R, 2)}``) against ``base``.

    Empty when ``base`` was not scored; ``base`` itself is left out.
    """
    if base not in nll:
        return {}
    return {g: paired_bootstrap(v, nll[base], statistic, seed=seed) for g, v in nll.items() if g != base}
