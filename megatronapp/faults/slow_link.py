"""Everything about ``slow_link``: the link between two ranks carries data
``factor`` x slower (a degraded cable, a congested port), for the whole run or
a window (a transfer starting inside it). On torch the receiver of each
message (or the sender, where sends are not coalesced) waits out the extra
time the simulator's link model gives that transfer."""
from __future__ import annotations

from typing import Any, Literal

import numpy as np

from ..io.schema import Factor, ScenarioError
from ..parallel.topology import Topology
from .effects import Window
from .protocol import Activity, Effects, FaultSpec, Job, LinkFault, Place, Timed, Truth
from .windows import missed, window_misses

__all__ = ["SlowLink", "link_span"]


def link_span(activity: Activity, ranks: tuple[int, int]) -> tuple[float, float] | None:
    """From the first compute to the last of either end of a link."""
    spans = [s for s in (activity.span(r) for r in ranks) if s is not None]
    if not spans:
        return None
    return min(a for a, _b in spans), max(b for _a, b in spans)


class SlowLink(Timed, LinkFault):
    kind: Literal["slow_link"]
    factor: Factor

    def check(self, job: Job, where: str) -> None:
        super().check(job, where)
        self.check_window(where)

    def effects(self, job: Job) -> Effects:
        return Effects(links=((self.pair, Window(self.start_s, self.end, self.factor)),))

    def truth(self, job: Job) -> tuple[Truth, ...]:
        return (Truth("slow_link", "link", self.ranks[0], self.ranks[1], injected=self.factor,
                      name=self.factor > 1),)

    def describe(self) -> str:
        return f"{self.link_text} {self.factor:.3g}x slow{self.during}"

    def idle(self, activity: Activity, where: str) -> ScenarioError | None:
        window = Window(self.start_s, self.end, self.factor)
        if window.steady:  # slow at every instant: no need to read what the ranks did
            return None
        span = link_span(activity, self.ranks)
        if span is None or not window_misses(window, span):
            return None
        return missed(where, f"the slow link's window misses what ranks {self.ranks[0]} and "
                      f"{self.ranks[1]} did", span)

    def moved(self, place: Place, elapsed_s: float) -> FaultSpec | None:
        moved = super().moved(place, elapsed_s)
        if moved is None or (self.start_s == 0.0 and self.end_s is None):
            return moved  # slow for the whole run: it stays so
        window = self.shifted(elapsed_s)
        return None if window is None else moved.model_copy(update=window)

    @classmethod
    def trial(cls, rng: np.random.Generator, topo: Topology, low: float, high: float,
              variant: str = "") -> dict[str, Any]:
        return {"kind": "slow_link", "ranks": cls.pipeline_pair(rng, topo),
                "factor": float(rng.uniform(low, high))}
