"""Held-out fit metrics between predicted and true K/V, accumulated over batches.

:class:`FitStats` streams: it keeps O(d) float64 sums, so the metrics of a map over a
whole validation split never need the split in memory.  Every map of the pipeline
(ridge, projector, adapters) reports the same five numbers through it.
"""

from __future__ import annotations

import torch


class FitStats:
    """Streaming R², mean cosine, relative MSE and MSE of predictions against truths.

    Definitions, over all ``n`` rows and ``d`` features seen (``y`` truth, ``p``
    prediction, ``ȳ_j`` the per-feature mean of the truth):

    * ``r2 = 1 - SSE / SST`` with ``SSE = Σ_ij (y_ij - p_ij)²`` and
      ``SST = Σ_ij (y_ij - ȳ_j)²``: one ratio of totals, which equals the
      variance-weighted average of the per-feature R² (scikit-learn's
      ``r2_score(multioutput="variance_weighted")``).  High-variance channels count
      more, as they do in the attention scores the K/V feed.
    * ``cos``: mean over rows of the cosine similarity between ``p_i`` and ``y_i``
      (``torch.nn.functional.cosine_similarity``, eps 1e-8).
    * ``rel_mse = SSE / Σ_ij y_ij²``: error energy relative to signal energy.
    * ``mse = SSE / (n d)``: mean over elements, as ``torch.nn.MSELoss`` computes it.

    Everything is accumulated in float64.  SST uses Chan et al.'s pairwise update of
    per-feature mean and sum of squared deviations, so a large common offset in the
    truth does not cancel away its variance.
    """

    def __init__(self):
        self.n = 0
        self._sse = 0.0
        self._sum_sq = 0.0
        self._cos_sum = 0.0
        self._mean = None  # (d,) running per-feature mean of the truth
        self._m2 = None  # (d,) running per-feature sum of squared deviations

    def update(self, pred: torch.Tensor, true: torch.Tensor) -> None:
        """Add a batch.

        Parameters
        ----------
        pred, true
            ``(n, d)`` float tensors of the same shape (any float dtype, any device).
        """
        if pred.shape != true.shape or pred.ndim != 2:
            raise ValueError(f"FitStats.update needs two (n, d) tensors of one shape, got {tuple(pred.shape)} "
                             f"and {tuple(true.shape)}")
        if pred.shape[0] == 0:
            return
        p, y = pred.detach().double().cpu(), true.detach().double().cpu()
        err = y - p
        self._sse += float((err * err).sum())
        self._sum_sq += float((y * y).sum())
        self._cos_sum += float(torch.nn.functional.cosine_similarity(p, y, dim=1, eps=1e-8).sum())
        mean_b = y.mean(0)
        self._merge_moments(y.shape[0], mean_b, ((y - mean_b) ** 2).sum(0))

    def merge(self, other: FitStats) -> FitStats:
        """Add the rows ``other`` has seen (another rank's share of a split); returns ``self``."""
        if other.n:
            self._sse += other._sse
            self._sum_sq += other._sum_sq
            self._cos_sum += other._cos_sum
            self._merge_moments(other.n, other._mean, other._m2)
        return self

    def _merge_moments(self, nb: int, mean_b: torch.Tensor, m2_b: torch.Tensor) -> None:
        """Chan et al.'s pairwise update with ``nb`` rows of per-feature mean ``mean_b`` and squared deviations ``m2_b``."""
        if self._mean is None:
            self.n, self._mean, self._m2 = nb, mean_b, m2_b
            return
        n = self.n + nb
        delta = mean_b - self._mean
        self._mean = self._mean + delta * (nb / n)
        self._m2 = self._m2 + m2_b + delta * delta * (self.n * nb / n)
        self.n = n

    def result(self) -> dict:
        """The metrics so far: ``{"r2", "cos", "rel_mse", "mse", "n"}`` (floats; ``n`` int).

        Raises ``ValueError`` when no rows were seen.
        """
        if self.n == 0:
            raise ValueError("FitStats.result called before any rows were added")
        sst = float(self._m2.sum())
        d = self._mean.shape[0]
        return {
            "r2": 1.0 - self._sse / sst if sst > 0 else float("nan"),
            "cos": self._cos_sum / self.n,
            "rel_mse": self._sse / self._sum_sq if self._sum_sq > 0 else float("nan"),
            "mse": self._sse / (self.n * d),
            "n": self.n,
        }


def merged(per_rank: list[dict[str, FitStats]]) -> dict[str, FitStats]:
    """One :class:`FitStats` per name from every rank's, merged in rank order (a rank without rows may lack names)."""
    out: dict[str, FitStats] = {}
    for stats in per_rank:
        for name, s in stats.items():
            out.setdefault(name, FitStats()).merge(s)
    return out
