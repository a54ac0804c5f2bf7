"""Faults must touch the job: after a run, a fault whose window of time
missed what its ranks did is refused (one line naming its field), unless the
scenario says ``allow_idle_faults: true``. The checks that need no run (ranks
that exchange no data, a skew on a job of one rank) refuse the scenario when
it is read; each kind says which of its own apply (``FaultSpec.idle``)."""
from __future__ import annotations

from functools import cached_property

import numpy as np

from ..scenario.config import Scenario
from ..trace.columns import KINDS, source_of
from ..trace.events import RunResult

__all__ = ["RunActivity", "check_faults_touched"]

COMPUTE = KINDS.index("compute")


class RunActivity:
    """When each rank of a finished run computed, and when the run ended (or
    was stopped by a failure)."""

    def __init__(self, result: RunResult):
        self.result = result

    @cached_property
    def _spans(self) -> dict[int, tuple[float, float]]:
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        for cols in source_of(self.result).batches():
            rows = cols.kind == COMPUTE
            ranks, inverse = np.unique(cols.rank[rows], return_inverse=True)
            lo, hi = np.full(len(ranks), np.inf), np.full(len(ranks), -np.inf)
            np.minimum.at(lo, inverse, cols.start_s[rows])
            np.maximum.at(hi, inverse, cols.end_s[rows])
            for r, a, b in zip(ranks.tolist(), lo.tolist(), hi.tolist()):
                first[r], last[r] = min(first.get(r, a), a), max(last.get(r, b), b)
        return {r: (first[r], last[r]) for r in first}

    def span(self, rank: int) -> tuple[float, float] | None:
        return self._spans.get(rank)

    @cached_property
    def end_s(self) -> float:
        ends = [b for _a, b in self._spans.values()]
        stopped = self.result.stopped["at_s"] if self.result.stopped else 0.0
        return max([*ends, stopped, 0.0])


def check_faults_touched(s: Scenario, result: RunResult) -> None:
    """Raise the first fault's ``ScenarioError`` that changed nothing in ``result``."""
    if s.allow_idle_faults or not s.faults:
        return
    activity = RunActivity(result)
    for i, fault in enumerate(s.faults):
        error = fault.idle(activity, f"faults[{i}]")
        if error is not None:
            raise error
