"""Devices: nominal work (seconds at full speed) to elapsed seconds, as the
injected faults say (``megatronapp.faults.Speed``: throttle windows, device
variation), plus background noise; and the host time a rank's faults put
before an op (``megatronapp.faults.HostStalls``). The engines ask here one op
at a time (``duration``); the compiled loop asks in bulk (``durations``), for
the very same numbers."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable

import numpy as np

from megatronapp.faults import HostDelay, HostStalls, Speed

from .draws import NormalStream, exact_exp


@dataclass
class Device:
    rank: int
    speed: Speed = field(default_factory=Speed)
    jitter_sigma: float = 0.0
    rng: np.random.Generator | None = None
    host: tuple[HostDelay, ...] = ()
    _noise: NormalStream | None = field(init=False, default=None)
    _stalls: HostStalls = field(init=False)

    def __post_init__(self) -> None:
        if self.jitter_sigma > 0 and self.rng is not None:
            self._noise = NormalStream(self.rng)
        self._stalls = HostStalls(self.host)

    @property
    def is_noisy(self) -> bool:
        return self._noise is not None

    @property
    def faulty(self) -> bool:
        """Its compute or its host is changed by a fault (each op is priced here)."""
        return not self.speed.plain or bool(self.host)

    @property
    def timed(self) -> bool:
        """Whether a duration depends on when the work starts (windows): if
        not, ``durations`` may be asked before the start times are known."""
        return bool(self.speed.windows)

    @property
    def iterated(self) -> bool:
        """Whether a duration or a host delay depends on the op's iteration
        (a window of every k-th iteration, a host stall)."""
        return bool(self.host) or any(w.every_k != 1 for w in self.speed.windows)

    @property
    def signature(self) -> Hashable:
        """What its timeline depends on; unique when it draws noise."""
        if self.is_noisy:
            return ("noise", self.rank)
        return self.speed, self.host

    def slowdown_at(self, t: float, iteration: int = -1) -> float:
        return self.speed.factor_at(t, iteration)

    def noisy(self, work_s: float) -> float:
        if self._noise is None:
            return work_s
        return work_s * math.exp(self.jitter_sigma * self._noise.draw())

    def duration(self, start_s: float, work_s: float, iteration: int = -1) -> float:
        """Elapsed time for ``work_s`` of nominal work starting at ``start_s``."""
        return self.speed.duration(start_s, self.noisy(work_s), iteration)

    def durations(self, starts: np.ndarray, work: np.ndarray,
                  iteration: np.ndarray | None = None) -> np.ndarray:
        """``duration`` of each piece of ``work`` starting at ``starts`` (in
        ``iteration``, default none), in this device's program order, in bulk:
        the noise is drawn for all at once, the same numbers one call each
        would give. Where the device is not ``timed`` the start times are not
        read."""
        work = np.asarray(work, np.float64)
        if self._noise is not None:
            work = work * exact_exp(self.jitter_sigma * self._noise.take(len(work)))
        if not self.timed:
            return work * self.speed.scale  # what ``Speed.duration`` gives without windows
        its = (np.full(len(work), -1, np.int64) if iteration is None
               else np.asarray(iteration, np.int64))
        return np.array([self.speed.duration(t, w, i) for t, w, i in zip(
            np.asarray(starts, np.float64).tolist(), work.tolist(), its.tolist())], np.float64)

    def host_delay_s(self, name: str, iteration: int) -> float:
        """Host time before this op (a rank's ops come here in program order)."""
        return self._stalls.before(name, iteration) if self.host else 0.0
