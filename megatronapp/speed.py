"""Simulator speed against a bare SimPy loop, measured in one process."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import simpy

from .config import Scenario, parse_scenario
from .tracer import RunScenario

JOB_1024 = {"name": "gpt-1024gpu", "schedule": "1f1b", "iterations": 1,
            "parallel": {"tp": 8, "pp": 8, "dp": 16, "microbatches": 32},
            "model": {"layers": 32, "hidden": 4096, "heads": 32, "seq_len": 4096,
                      "vocab": 50304, "micro_batch_size": 1}}


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


@dataclass(frozen=True)
class SimSpeed:
    ops: int
    wall_s: float

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.wall_s


def simulate_speed(s: Scenario, run: RunScenario) -> SimSpeed:
    """Time ``run(s)`` (a backend's run function, handed in by the caller)."""
    start = time.perf_counter()
    result = run(s)
    wall = time.perf_counter() - start
    return SimSpeed(sum(len(v) for v in result.events.values()), wall)


def job_1024() -> Scenario:
    return parse_scenario(JOB_1024)
