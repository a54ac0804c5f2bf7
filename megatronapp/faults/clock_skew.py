"""Everything about ``clock_skew``: a rank's clock is off by ``offset_us`` and
runs ``drift_ppm`` fast or slow. Nothing runs differently; the trace records
the rank's own clock, which MegaScan's aligner must undo (it is the
aligner's to find, not a cause a detector names)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..io.schema import MAX_DRIFT_PPM, MAX_OFFSET_US, ScenarioError
from .protocol import Effects, Job, RankFault, Truth

__all__ = ["ClockSkew"]


class ClockSkew(RankFault):
    kind: Literal["clock_skew"]
    offset_us: float = Field(0.0, ge=-MAX_OFFSET_US, le=MAX_OFFSET_US)
    drift_ppm: float = Field(0.0, ge=-MAX_DRIFT_PPM, le=MAX_DRIFT_PPM)

    def check(self, job: Job, where: str) -> None:
        super().check(job, where)
        if job.world == 1 and not job.allow_idle:
            raise ScenarioError(f"{where}.rank", "a job of one rank has no other clock to be "
                                "aligned with: the skew changes nothing (allow_idle_faults: "
                                "true accepts it)")

    def describe(self) -> str:
        return (f"clock of rank {self.rank} off by {self.offset_us / 1e3:.3g} ms, drifting "
                f"{self.drift_ppm:.3g} ppm")

    def effects(self, job: Job) -> Effects:
        return Effects(clocks=((self.rank, self.offset_us, self.drift_ppm),))

    def truth(self, job: Job) -> tuple[Truth, ...]:
        return (Truth("clock_skew", "clock", self.rank, injected=self.offset_us, unit="us",
                      name=False),)
