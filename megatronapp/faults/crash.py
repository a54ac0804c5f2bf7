"""Everything about ``crash``: a fail-stop fault (a crashed process, a CUDA or
ECC error, an NCCL timeout). At ``at_s`` the rank's process dies; its peers
block on it until the job stops, NCCL-timeout-like, and the stop is recorded
in the run's summary. With ``mtbf_hours`` instead, every device (or ``rank``
alone) fails at a seeded exponential time with that mean; the job stops at the
first. The closed loop restarts the job from its last checkpoint. On torch
the rank's process kills itself at the first op at or after ``at_s``."""
from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field

from ..io.schema import Rank, ScenarioError, Seconds
from ..parallel.topology import Topology
from .protocol import Activity, Effects, FaultSpec, Job, Place, Truth

__all__ = ["Crash"]

STREAM = 19  # the failure times' random stream


class Crash(FaultSpec):
    kind: Literal["crash"]
    rank: Rank | None = None  # unset (with mtbf_hours): any device
    at_s: Seconds | None = None
    mtbf_hours: float | None = Field(None, gt=0, le=1e9)  # per device
    cause: str | None = Field(None, max_length=100)  # what fails (a label for reports)
    # which draws of the seed's failure stream: a job restarted after a failure takes the next
    restarts: int = Field(0, ge=0, le=2**31 - 1)
    OMIT_WHEN_UNSET = ("cause", "restarts")

    def describe(self) -> str:
        who = "any device" if self.rank is None else f"rank {self.rank}"
        when = (f"at {self.at_s:.3g} s" if self.at_s is not None
                else f"once in {self.mtbf_hours:,.6g} h on average")
        return f"{who} fails {when}" + (f" ({self.cause})" if self.cause else "")

    def named_ranks(self) -> tuple[int, ...]:
        return () if self.rank is None else (self.rank,)

    def check(self, job: Job, where: str) -> None:
        super().check(job, where)
        if (self.at_s is None) == (self.mtbf_hours is None):
            raise ScenarioError(f"{where}.at_s", "give at_s (when the rank fails) or mtbf_hours "
                                "(each device's mean time between failures), not both")
        if self.at_s is not None and self.rank is None:
            raise ScenarioError(f"{where}.rank", "at_s needs the rank that fails")
        if job.decoupled:
            raise ScenarioError(f"{where}.kind", "a crash does not stop a decoupled (fbd) run yet")

    def devices(self, job: Job) -> int:
        """How many devices this fault can stop."""
        return 1 if self.rank is not None else job.world

    def failure_rate_per_s(self, job: Job) -> float:
        """The job's failure rate from this fault (0 for one failure at a time)."""
        if self.mtbf_hours is None:
            return 0.0
        return self.devices(job) / (self.mtbf_hours * 3600.0)

    def first_failure(self, job: Job) -> tuple[int, float]:
        """(rank, seconds) of the first failure."""
        if self.at_s is not None and self.rank is not None:
            return self.rank, self.at_s
        assert self.mtbf_hours is not None
        times = job.rng(STREAM, self.restarts).exponential(self.mtbf_hours * 3600.0,
                                                            self.devices(job))
        first = int(np.argmin(times))
        return (self.rank if self.rank is not None else first), float(times[first])

    def effects(self, job: Job) -> Effects:
        return Effects(stops=(self.first_failure(job),))

    def truth(self, job: Job) -> tuple[Truth, ...]:
        rank, at = self.first_failure(job)
        return (Truth("crash", "stop", rank, injected=at, unit="s"),)

    def idle(self, activity: Activity, where: str) -> ScenarioError | None:
        if self.at_s is None or self.at_s <= activity.end_s:
            return None
        return ScenarioError(f"{where}.at_s", f"{self.at_s:g} s is after the job ends "
                             f"({activity.end_s:.6g} s): it changes nothing "
                             "(allow_idle_faults: true accepts it)")

    def moved(self, place: Place, elapsed_s: float) -> FaultSpec | None:
        if self.at_s is not None and self.at_s <= elapsed_s:
            return None  # it has happened
        moved = super().moved(place, elapsed_s)
        if moved is None:
            return None
        if self.at_s is None:  # failures without memory: the same rate, new draws
            return moved.model_copy(update={"restarts": self.restarts + 1})
        return moved.model_copy(update={"at_s": self.at_s - elapsed_s})

    @classmethod
    def trial(cls, rng: np.random.Generator, topo: Topology, low: float, high: float,
              variant: str = "") -> dict[str, Any]:
        return {"kind": "crash", "rank": int(rng.integers(topo.world_size)),
                "at_s": float(rng.uniform(low, high))}
