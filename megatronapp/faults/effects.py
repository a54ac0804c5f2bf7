"""What a fault does to a job, as data and pure functions that every engine
interprets the same way: the simulator's reference interpreter and compiled
engine, and the torch backend (which sleeps what the data says).

- ``Window``: ``factor`` x slower inside a stretch of time, optionally only for
  the first ``duty`` of every ``period_s`` and only in every ``every_k``-th
  iteration (compute of a rank, or uses of a link).
- ``Speed``: a rank's compute as a function of start time, nominal work and
  iteration: windows times a constant ``scale``; vectorised over numpy arrays.
- ``HostDelay``: host time before the iteration's first op of a name (a data
  loader before the forward, a checkpoint write before the optimizer step).
- ``Outage``: a link down for ``down_s`` every ``every_s``; a transfer that
  meets it waits for the link and the transport's retry.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

__all__ = ["HostDelay", "HostStalls", "Outage", "Speed", "Window", "gate_open"]

INITIAL_HORIZON_S = 1.0  # a profile is built this far first, then doubled as asked


def gate_open(every_k: int, iteration: int) -> bool:
    """Whether an every-``every_k``-th-iteration fault acts in ``iteration``
    (the k-th, 2k-th, ...: iterations k-1, 2k-1, ...); one outside any
    iteration (-1) is hit only by a fault of every iteration."""
    return every_k == 1 or (iteration >= 0 and iteration % every_k == every_k - 1)


@dataclass(frozen=True)
class Window:
    """``factor`` x slow from ``start_s`` to ``end_s``: the whole stretch, or the
    first ``duty`` of every ``period_s`` from ``start_s``; in every
    ``every_k``-th iteration only (compute)."""

    start_s: float = 0.0
    end_s: float = math.inf
    factor: float = 1.0
    period_s: float | None = None
    duty: float = 1.0
    every_k: int = 1

    @property
    def steady(self) -> bool:
        """The same for the whole run: a constant factor."""
        return (self.start_s <= 0.0 and self.end_s == math.inf and self.period_s is None
                and self.every_k == 1)

    def next_edge(self, t: float) -> float:
        """The first instant after ``t`` at which its factor changes."""
        if t < self.start_s:
            return self.start_s
        if t >= self.end_s:
            return math.inf
        if self.period_s is None:
            return self.end_s
        k = self._period(t, self.period_s)
        slow_end = self.start_s + k * self.period_s + self.duty * self.period_s
        edge = slow_end if t < slow_end else self.start_s + (k + 1) * self.period_s
        return min(edge, self.end_s)

    def _period(self, t: float, period: float) -> int:
        """The period holding ``t`` (>= start_s), its start as ``pieces`` computes
        it (start_s + k x period), not by a modulo that rounds."""
        k = math.floor((t - self.start_s) / period)
        while self.start_s + (k + 1) * period <= t:
            k += 1
        while k > 0 and self.start_s + k * period > t:
            k -= 1
        return k

    def covers(self, t: float) -> bool:
        if not self.start_s <= t < self.end_s:
            return False
        if self.period_s is None:
            return True
        k = self._period(t, self.period_s)
        return t < self.start_s + k * self.period_s + self.duty * self.period_s

    def factor_at(self, t: float) -> float:
        return self.factor if self.covers(t) else 1.0

    def factors(self, t: np.ndarray) -> np.ndarray:
        """``factor_at`` over an array of instants."""
        t = np.asarray(t, dtype=float)
        inside = (t >= self.start_s) & (t < self.end_s)
        if self.period_s is not None:
            k = np.floor((t - self.start_s) / self.period_s)
            inside &= t < self.start_s + k * self.period_s + self.duty * self.period_s
        return np.where(inside, self.factor, 1.0)

    def pieces(self, until: float) -> Iterator[tuple[float, float]]:
        """The stretches before ``until`` in which it is slow."""
        stop = min(self.end_s, until)
        if self.period_s is None:
            if self.start_s < stop:
                yield self.start_s, stop
            return
        k = 0
        while (a := self.start_s + k * self.period_s) < stop:
            yield a, min(a + self.duty * self.period_s, stop)
            k += 1


class _Profile:
    """Cumulative nominal work done by time t for a product of windows: piecewise
    linear (slope 1 / factor), so start time -> end time is two interpolations."""

    def __init__(self, windows: Sequence[Window], scale: float):
        self.windows, self.scale = tuple(windows), scale
        self.horizon = 0.0
        self.times = self.work = np.zeros(1)
        self._build(INITIAL_HORIZON_S)

    def _build(self, horizon: float) -> None:
        pieces = [(a, b, w.factor) for w in self.windows for a, b in w.pieces(horizon)]
        edges = np.unique(np.array([0.0, horizon] + [p for a, b, _f in pieces for p in (a, b)]))
        log_factor = np.zeros(len(edges))
        for a, b, f in pieces:  # a window multiplies the segments it covers
            log_factor[np.searchsorted(edges, a)] += math.log(f)
            log_factor[np.searchsorted(edges, b)] -= math.log(f)
        factor = self.scale * np.exp(np.cumsum(log_factor)[:-1])
        self.times = edges
        self.work = np.concatenate(([0.0], np.cumsum(np.diff(edges) / factor)))
        self.horizon = horizon

    def ends(self, start: np.ndarray, work: np.ndarray) -> np.ndarray:
        target = np.interp(start, self.times, self.work) + work
        while start.size and (start.max() >= self.horizon or target.max() >= self.work[-1]):
            self._build(2 * max(self.horizon, float(start.max()) + 1.0))
            target = np.interp(start, self.times, self.work) + work
        return np.interp(target, self.work, self.times)


@dataclass(frozen=True)
class Speed:
    """A rank's compute: ``scale`` x the product of the windows that hold it."""

    windows: tuple[Window, ...] = ()
    scale: float = 1.0
    _profiles: dict[tuple[bool, ...], _Profile] = field(default_factory=dict, compare=False,
                                                        hash=False, repr=False)

    @property
    def plain(self) -> bool:
        return not self.windows and self.scale == 1.0

    def factor_at(self, t: float, iteration: int = -1) -> float:
        f = self.scale
        for w in self.windows:
            if gate_open(w.every_k, iteration):
                f *= w.factor_at(t)
        return f

    def _profile(self, gates: tuple[bool, ...]) -> _Profile:
        profile = self._profiles.get(gates)
        if profile is None:
            active = [w for w, g in zip(self.windows, gates) if g]
            profile = self._profiles[gates] = _Profile(active, self.scale)
        return profile

    def durations(self, start: np.ndarray, work: np.ndarray,
                  iteration: np.ndarray | None = None) -> np.ndarray:
        """Elapsed seconds of ``work`` nominal seconds starting at ``start``
        (arrays of one shape; ``iteration`` picks the windows that act)."""
        start = np.asarray(start, dtype=float)
        work = np.asarray(work, dtype=float)
        if not self.windows:
            return work * self.scale
        its = np.full(start.shape, -1) if iteration is None else np.asarray(iteration)
        out = np.empty(start.shape)
        for i in np.unique(its).tolist():
            mine = its == i
            gates = tuple(gate_open(w.every_k, i) for w in self.windows)
            out[mine] = self._profile(gates).ends(start[mine], work[mine]) - start[mine]
        return out

    def duration(self, start: float, work: float, iteration: int = -1) -> float:
        """One op's ``durations``, walking the edges of the windows it meets
        (a partial window pro rata)."""
        active = [w for w in self.windows if gate_open(w.every_k, iteration)]
        if not active:
            return work * self.scale
        t, left = start, work
        while True:
            slow = self.scale
            for w in active:
                slow *= w.factor_at(t)
            edge = min(w.next_edge(t) for w in active)
            if left * slow <= edge - t:
                return t + left * slow - start
            left -= (edge - t) / slow
            t = edge


@dataclass(frozen=True)
class HostDelay:
    """Host time before the first ``before`` op (forward, optimizer) of every
    ``every_k``-th iteration: ``seconds``, or lognormal around it (``sigma``),
    each iteration's draw a function of the job's seed and the iteration."""

    seconds: float
    before: str = "forward"
    every_k: int = 1
    sigma: float = 0.0
    entropy: tuple[int, ...] = ()  # the random stream of the draws

    def seconds_at(self, iteration: int) -> float:
        if not gate_open(self.every_k, iteration):
            return 0.0
        if self.sigma == 0.0:
            return self.seconds
        z = np.random.default_rng([*self.entropy, iteration]).standard_normal()
        return self.seconds * math.exp(self.sigma * z - self.sigma ** 2 / 2)  # mean: seconds

    def iterations(self, count: int) -> tuple[int, ...]:
        return tuple(i for i in range(count) if gate_open(self.every_k, i))


class HostStalls:
    """A rank's host delays as its ops go by in program order: the delay due
    before an op (once per delay and iteration)."""

    def __init__(self, delays: Sequence[HostDelay]):
        self.delays = tuple(delays)
        self._done: set[tuple[int, int]] = set()

    def __bool__(self) -> bool:
        return bool(self.delays)

    def before(self, name: str, iteration: int) -> float:
        total = 0.0
        for k, d in enumerate(self.delays):
            if d.before == name and iteration >= 0 and (k, iteration) not in self._done:
                self._done.add((k, iteration))
                total += d.seconds_at(iteration)
        return total


@dataclass(frozen=True)
class Outage:
    """A link down for ``down_s`` at ``start_s``, then every ``every_s`` until
    ``end_s``; a transfer that meets an outage resumes ``retry_s`` after the
    link is back (the transport's retransmission timeout)."""

    down_s: float
    every_s: float
    retry_s: float
    start_s: float = 0.0
    end_s: float = math.inf

    def delay_s(self, t: float, nominal_s: float = 0.0) -> float:
        """What a transfer starting at ``t`` that would take ``nominal_s`` loses:
        the rest of the outage it starts in, or of the first one starting under it."""
        if t + nominal_s < self.start_s or t >= self.end_s:
            return 0.0
        k = max(0, math.floor((t - self.start_s) / self.every_s))
        down = self.start_s + k * self.every_s
        if t >= down + self.down_s:  # past this one: the next, if it starts under the transfer
            down += self.every_s
        if down > t + nominal_s or down >= self.end_s:
            return 0.0
        return down + self.down_s - max(t, down) + self.retry_s

    def delays_s(self, t: np.ndarray, nominal_s: np.ndarray | float = 0.0) -> np.ndarray:
        """``delay_s`` over arrays of transfers."""
        t = np.asarray(t, dtype=float)
        end = t + nominal_s
        k = np.maximum(0.0, np.floor((t - self.start_s) / self.every_s))
        down = self.start_s + k * self.every_s
        down = np.where(t >= down + self.down_s, down + self.every_s, down)
        hit = (end >= self.start_s) & (t < self.end_s) & (down <= end) & (down < self.end_s)
        return np.where(hit, down + self.down_s - np.maximum(t, down) + self.retry_s, 0.0)

    def downs(self, until: float) -> Iterator[float]:
        """When the link goes down, before ``until``."""
        k = 0
        while (t := self.start_s + k * self.every_s) < min(until, self.end_s):
            yield t
            k += 1
