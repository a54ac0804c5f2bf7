"""A bare SimPy loop: the ceiling against which the simulator's speed is judged."""
from __future__ import annotations

import time
from typing import Callable

import simpy


def _bare_loop(n: int, clock: Callable[[], float]) -> float:
    """Seconds (on ``clock``) for one process yielding ``n`` timeouts."""
    env = simpy.Environment()

    def loop():
        for _ in range(n):
            yield env.timeout(1)

    env.process(loop())
    start = clock()
    env.run()
    return clock() - start


def bare_simpy_events_per_s(n: int = 200_000) -> float:
    """One process yielding ``n`` timeouts: the ceiling for any SimPy model."""
    return n / _bare_loop(n, time.perf_counter)


def bare_simpy_cpu_s_per_event(n: int = 200_000) -> float:
    """CPU seconds per timeout of the bare loop (steadier than wall time on a busy machine)."""
    return _bare_loop(n, time.process_time) / n
