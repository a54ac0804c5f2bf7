"""Devices whose compute speed injected throttling changes over time."""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np

from .draws import NormalStream, exact_exp


@dataclass(frozen=True)
class ThrottleWindow:
    """A stretch of time in which a device (or a link) is ``factor`` x slow."""

    start_s: float
    end_s: float  # math.inf for "until the end"
    factor: float  # compute (or a transfer) takes factor x as long inside the window


def factor_at(windows: tuple[ThrottleWindow, ...], t: float) -> float:
    """The product of the factors of the windows that hold ``t``."""
    factor = 1.0
    for w in windows:
        if w.start_s <= t < w.end_s:
            factor *= w.factor
    return factor


@dataclass
class Device:
    """Turns nominal work (seconds at full speed) into elapsed seconds."""

    rank: int
    windows: tuple[ThrottleWindow, ...] = ()
    jitter_sigma: float = 0.0
    rng: np.random.Generator | None = None
    _breaks: list[float] = field(init=False, default_factory=list)
    _noise: NormalStream | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        points = {w.start_s for w in self.windows} | {w.end_s for w in self.windows}
        self._breaks = sorted(p for p in points if math.isfinite(p))
        if self.jitter_sigma > 0 and self.rng is not None:
            self._noise = NormalStream(self.rng)

    @property
    def is_noisy(self) -> bool:
        return self._noise is not None

    def slowdown_at(self, t: float) -> float:
        return factor_at(self.windows, t)

    def noisy(self, work_s: float) -> float:
        if self._noise is None:
            return work_s
        return work_s * math.exp(self.jitter_sigma * self._noise.draw())

    @property
    def timed(self) -> bool:
        """Whether a duration depends on when the work starts (throttle windows):
        if not, ``durations`` may be asked before the start times are known."""
        return bool(self.windows)

    def duration(self, start_s: float, work_s: float) -> float:
        """Elapsed time for ``work_s`` of nominal work starting at ``start_s``."""
        return self._stretched(start_s, self.noisy(work_s))

    def durations(self, starts: np.ndarray, work: np.ndarray) -> np.ndarray:
        """``duration`` of each piece of ``work`` starting at ``starts``, in this
        device's program order, in bulk: the noise is drawn for all at once, the
        same numbers one call each would give. Where the device is not ``timed``
        the start times are not read."""
        work = np.asarray(work, np.float64)
        if self._noise is not None:
            work = work * exact_exp(self.jitter_sigma * self._noise.take(len(work)))
        if not self.windows:
            return work
        return np.array([self._stretched(t, w) for t, w in zip(np.asarray(starts).tolist(),
                                                                work.tolist())], np.float64)

    def _stretched(self, start_s: float, work: float) -> float:
        """Elapsed time for ``work`` (noise applied) inside the throttle windows."""
        if not self.windows:
            return work
        t, left = start_s, work
        i = bisect.bisect_right(self._breaks, t)
        while True:
            slow = self.slowdown_at(t)
            nxt = self._breaks[i] if i < len(self._breaks) else math.inf
            if left * slow <= nxt - t:
                return t + left * slow - start_s
            left -= (nxt - t) / slow
            t, i = nxt, i + 1
