"""Fail-stop faults over a long job: crashes at a given rate, checkpoints at a
given interval, a restart after each crash from the last checkpoint, and the
goodput that results.

A job of ``iterations`` steps of ``iteration_s`` each writes a checkpoint
(``checkpoint_s``, blocking) after every ``checkpoint_every`` steps but the
last. Failures arrive as a Poisson process in wall time (memoryless: after a
restart the next is drawn afresh; none during the restart itself). A failure
loses the work since the last checkpoint; training resumes ``restart_s``
later. Between two failures progress is deterministic, so the timeline is
computed one failure at a time: a job of millions of steps and thousands of
failures takes milliseconds. The step time comes from simulating the job's
first steps (``megatronapp failstop``), not from simulating all of them.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["FailStopJob", "FailStopRun", "failstop_run", "geometric_grid", "sweep",
           "young_daly_s"]


@dataclass(frozen=True)
class FailStopJob:
    iteration_s: float
    iterations: int
    checkpoint_s: float
    restart_s: float
    mtbf_s: float  # the job's mean time between failures (inf: none)

    def work_s(self, steps: int, every: int) -> float:
        """Wall time of ``steps`` steps from a checkpoint, without failures:
        a checkpoint after each full ``every`` but the job's last."""
        return steps * self.iteration_s + self.checkpoint_s * (math.ceil(steps / every) - 1)


@dataclass(frozen=True)
class FailStopRun:
    checkpoint_every: int
    wall_s: float
    useful_s: float  # the steps alone: iterations x iteration_s
    failures: int
    lost_s: float  # work done since the last checkpoint when a failure struck
    restarts_s: float
    checkpoints_s: float

    @property
    def goodput(self) -> float:
        """Useful time over wall time (the effective training time ratio)."""
        return self.useful_s / self.wall_s

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "goodput": self.goodput}


def failstop_run(job: FailStopJob, every: int, rng: np.random.Generator) -> FailStopRun:
    """The job's timeline with a checkpoint every ``every`` steps, failures
    drawn from ``rng``."""
    t, done, failures, lost, checkpoints = 0.0, 0, 0, 0.0, 0
    chunk_s = every * job.iteration_s + job.checkpoint_s
    while True:
        left = job.iterations - done
        finish = job.work_s(left, every)
        x = rng.exponential(job.mtbf_s) if math.isfinite(job.mtbf_s) else math.inf
        if x >= finish:
            checkpoints += math.ceil(left / every) - 1
            t += finish
            break
        chunks = min(int(x // chunk_s), math.ceil(left / every) - 1)
        done += chunks * every
        checkpoints += chunks
        failures += 1
        lost += x - chunks * chunk_s
        t += x + job.restart_s
    return FailStopRun(every, t, job.iterations * job.iteration_s, failures, lost,
                       failures * job.restart_s, checkpoints * job.checkpoint_s)


def sweep(job: FailStopJob, everies: Sequence[int], seed: int) -> list[FailStopRun]:
    """``failstop_run`` at each interval, all on the same failure draws (common
    random numbers: the comparison sees the intervals, not the luck)."""
    return [failstop_run(job, every, np.random.default_rng(seed)) for every in everies]


def young_daly_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's (and Daly's first-order) optimal work between checkpoints."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def geometric_grid(center: float, ratio: float, steps: int) -> list[int]:
    """Whole intervals around ``center`` (steps), ``ratio`` apart, ``steps``
    each way (at least 1, no repeats)."""
    values = (center * ratio ** k for k in range(-steps, steps + 1))
    return sorted({max(1, round(v)) for v in values})
