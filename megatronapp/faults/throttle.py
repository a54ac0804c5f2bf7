"""Everything about ``throttle``: a rank whose compute runs ``factor`` x slow
(thermal throttling, a noisy neighbour, a degraded GPU), for a window of time
or intermittently: the first ``duty`` of every ``period_s``, and/or only in
every ``every_k_iterations``-th iteration. Its kernels take longer; the host
issues them on time. On torch the rank sleeps after each compute as long as
the throttled device would have taken more."""
from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field

from ..io.schema import Factor, PositiveInt, ScenarioError
from ..parallel.topology import Topology
from .effects import Window, gate_open
from .protocol import (Activity, Effects, FaultCost, FaultSpec, Job, Place, RankFault, Timed,
                       Truth, every_kth)
from .windows import missed, window_misses

__all__ = ["Throttle", "hit_iterations"]


def hit_iterations(every_k: int, iterations: int) -> tuple[int, ...] | None:
    """The iterations an every-k-th fault acts in (None: every one)."""
    if every_k == 1:
        return None
    return tuple(i for i in range(iterations) if gate_open(every_k, i))


def check_every_k(every_k: int, job: Job, where: str) -> None:
    if every_k > job.iterations and not job.allow_idle:
        raise ScenarioError(f"{where}.every_k_iterations",
                            f"{every_k} is more than the job's {job.iterations} iterations: it "
                            "never acts (allow_idle_faults: true accepts it)")


class Throttle(Timed, RankFault):
    kind: Literal["throttle"]
    factor: Factor
    period_s: float | None = Field(None, gt=0, le=1e9)  # intermittent: a period, seconds
    duty: float = Field(1.0, gt=0, le=1)  # the share of each period that is slow (its start)
    every_k_iterations: PositiveInt = 1  # only the k-th, 2k-th, ... iteration
    OMIT_WHEN_UNSET = ("period_s", "duty", "every_k_iterations")

    @property
    def window(self) -> Window:
        return Window(self.start_s, self.end, self.factor, self.period_s, self.duty,
                      self.every_k_iterations)

    def check(self, job: Job, where: str) -> None:
        super().check(job, where)
        self.check_window(where)
        if self.duty < 1 and self.period_s is None:
            raise ScenarioError(f"{where}.duty", "needs period_s (slow for that share of it)")
        check_every_k(self.every_k_iterations, job, where)

    def effects(self, job: Job) -> Effects:
        return Effects(compute=((self.rank, self.window),))

    def truth(self, job: Job) -> tuple[Truth, ...]:
        return (Truth("throttle", "compute", self.rank,
                      iterations=hit_iterations(self.every_k_iterations, job.iterations),
                      injected=self.factor, name=self.factor > 1),)

    def idle(self, activity: Activity, where: str) -> ScenarioError | None:
        if self.window.steady:  # slow at every instant: no need to read when the rank computed
            return None
        span = activity.span(self.rank)
        if span is None or not window_misses(self.window, span):
            return None
        return missed(where, f"the throttle's window misses rank {self.rank}'s compute", span)

    def moved(self, place: Place, elapsed_s: float) -> FaultSpec | None:
        moved = super().moved(place, elapsed_s)
        window = self.shifted(elapsed_s)
        return None if moved is None or window is None else moved.model_copy(update=window)

    def cost(self, job: Job) -> FaultCost:
        return FaultCost(windows={self.rank: 1})

    def describe(self) -> str:
        text = f"rank {self.rank} at 1/{self.factor:.3g} speed{self.during}"
        if self.period_s is not None:
            text += f", the first {self.duty:.0%} of every {self.period_s:.3g} s"
        if self.every_k_iterations > 1:
            text += f", in {every_kth(self.every_k_iterations)}"
        return text

    @classmethod
    def trial(cls, rng: np.random.Generator, topo: Topology, low: float, high: float,
              variant: str = "") -> dict[str, Any]:
        """``every3``: one slow iteration in three; ``periodic``: slow half the time
        in ``period`` seconds (the variant's number, default 0.05)."""
        fault: dict[str, Any] = {"kind": "throttle", "rank": int(rng.integers(topo.world_size)),
                                 "factor": float(rng.uniform(low, high))}
        if variant.startswith("every"):
            fault["every_k_iterations"] = int(variant[5:] or 3)
        elif variant.startswith("periodic"):
            fault.update(period_s=float(variant[8:] or 0.05), duty=0.5)
        return fault
