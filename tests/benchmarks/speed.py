"""Simulator speed, measured in one process (the bare SimPy loop it is judged
against is ``sim.bare_simpy_events_per_s``)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from megatronapp.scenario.config import Scenario, parse_scenario
from megatronapp.trace.events import RunScenario

JOB_1024 = {"name": "gpt-1024gpu", "schedule": "1f1b", "iterations": 1,
            "parallel": {"tp": 8, "pp": 8, "dp": 16, "microbatches": 32},
            "model": {"layers": 32, "hidden": 4096, "heads": 32, "seq_len": 4096,
                      "vocab": 50304, "micro_batch_size": 1}}


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
