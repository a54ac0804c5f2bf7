"""A scenario's long job under fail-stop faults: its step time from simulating
its first steps, its failure rate from its faults (each kind says its own),
its checkpoint and restart costs from its ``mitigation`` section."""
from __future__ import annotations

import statistics
from typing import Callable

from megatronapp.errors import UserError
from megatronapp.scenario.config import Mitigation, Scenario, fault_job
from megatronapp.trace.events import RunResult
from megatronapp.trace.summary import run_iteration_times

from .failstop import FailStopJob

__all__ = ["STEPS_SIMULATED", "failstop_job", "step_s"]

STEPS_SIMULATED = 3  # the first is a warm-up (an empty pipeline, no gathers overlapped)


def failure_rate_per_s(s: Scenario) -> float:
    job = fault_job(s)
    return sum(f.failure_rate_per_s(job) for f in s.faults)


def without_stops(s: Scenario, steps: int) -> Scenario:
    """``s`` for ``steps`` steps, without the faults that stop it (before a
    failure the job runs as if it had none)."""
    job = fault_job(s)
    kept = tuple(f for f in s.faults if not f.effects(job).stops)
    return s.model_copy(update={"iterations": steps, "faults": kept})


def step_s(s: Scenario, run: Callable[[Scenario], RunResult]) -> float:
    """One steady step of ``s``: the median of its simulated steps after the first."""
    times = run_iteration_times(run(without_stops(s, min(STEPS_SIMULATED, s.iterations))))
    return statistics.median(times[1:] or times)


def failstop_job(s: Scenario, iteration_s: float) -> FailStopJob:
    rate = failure_rate_per_s(s)
    if rate <= 0:
        raise UserError("faults: no fail-stop fault with a rate (a crash with mtbf_hours)")
    m = s.mitigation or Mitigation()
    return FailStopJob(iteration_s, s.iterations, m.checkpoint_s, m.restart_s, 1.0 / rate)
