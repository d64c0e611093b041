"""The progress bar every stage, study and benchmark draws: tqdm with an ETA that ignores the first step.

A loop's first step carries its warm-up (the model's first forward allocates, the first kernels
compile, lazy weights load), often a minute where a later step takes a second; tqdm's rate,
whether its moving average or the overall mean, starts from that step and predicts hours for a
step of minutes.  :class:`Progress` times the steps after the first only, and shows ``?`` as the
ETA until there is one.
"""

from __future__ import annotations

from tqdm import tqdm


class Progress(tqdm):
    """``tqdm`` (same arguments) whose rate and ETA count only the steps after its first update.

    The rate is the mean over those steps, so ``remaining = (total - n) × (mean step after the first)``.
    """

    def __init__(self, *args, **kwargs):
        self._warm: tuple[float, float] | None = None  # (n, clock) at the end of the first update
        super().__init__(*args, **kwargs)

    def update(self, n: float = 1) -> bool | None:
        # tqdm refreshes inside update(), so the first step's own line is drawn before _warm is set: ETA '?'.
        shown = super().update(n)
        if self._warm is None and not self.disable and self.n > self.initial:
            self._warm = (self.n, self._time())
        return shown

    def reset(self, total: float | None = None) -> None:
        self._warm = None
        super().reset(total)

    @property
    def format_dict(self) -> dict:
        fields = super().format_dict
        if self.disable:
            return fields
        steps, seconds = ((self.n - self._warm[0], self._time() - self._warm[1]) if self._warm else (0, 0))
        # A rate of 0 is tqdm's "unknown" ('?'); None would make it fall back to the mean since the start.
        fields["rate"] = steps / seconds if steps > 0 and seconds > 0 else 0
        return fields
