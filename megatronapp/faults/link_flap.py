"""Everything about ``link_flap``: the link between two ranks drops for
``down_ms`` at ``start_s`` and then every ``every_s`` (a NIC or switch port
that goes down and comes back), rather than being uniformly slow. A transfer
that meets a drop waits until the link is back, then the transport's
retransmission timeout (``retry_ms``; default InfiniBand's minimum with
NCCL_IB_TIMEOUT 18, 4.096 us x 2^18 = 1.07 s). On torch the transfer is
delayed by what the same model says."""
from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field

from ..io.schema import ScenarioError, Seconds
from ..parallel.topology import Topology
from .effects import Outage
from .protocol import Activity, Effects, FaultSpec, Job, LinkFault, Place, Timed, Truth
from .slow_link import link_span
from .windows import missed

__all__ = ["LinkFlap"]

IB_RETRY_S = 4.096e-6 * 2**18  # NCCL_IB_TIMEOUT 18: the verbs' local ACK timeout


class LinkFlap(Timed, LinkFault):
    kind: Literal["link_flap"]
    down_ms: float = Field(gt=0, le=1e9)
    every_s: float = Field(gt=0, le=1e9)
    retry_ms: Seconds | None = None  # None: IB_RETRY_S

    @property
    def outage(self) -> Outage:
        retry = IB_RETRY_S if self.retry_ms is None else self.retry_ms * 1e-3
        return Outage(self.down_ms * 1e-3, self.every_s, retry, self.start_s, self.end)

    def describe(self) -> str:
        return f"{self.link_text} down {self.down_ms:.3g} ms every {self.every_s:.3g} s{self.during}"

    def check(self, job: Job, where: str) -> None:
        super().check(job, where)
        self.check_window(where)
        if self.down_ms * 1e-3 >= self.every_s:
            raise ScenarioError(f"{where}.down_ms", f"{self.down_ms:g} ms down every "
                                f"{self.every_s:g} s never comes back up")

    def effects(self, job: Job) -> Effects:
        return Effects(outages=((self.pair, self.outage),))

    def truth(self, job: Job) -> tuple[Truth, ...]:
        return (Truth("link_flap", "link", self.ranks[0], self.ranks[1], injected=self.down_ms,
                      unit="ms"),)

    def idle(self, activity: Activity, where: str) -> ScenarioError | None:
        span = link_span(activity, self.ranks)
        if span is None or any(t + self.down_ms * 1e-3 > span[0]
                               for t in self.outage.downs(span[1])):
            return None
        return missed(where, "no drop of the link falls in what its ranks did", span)

    def moved(self, place: Place, elapsed_s: float) -> FaultSpec | None:
        moved = super().moved(place, elapsed_s)
        window = self.shifted(elapsed_s)
        if moved is None or window is None:
            return None
        phase = (elapsed_s - self.start_s) % self.every_s if elapsed_s > self.start_s else 0.0
        window["start_s"] = window["start_s"] + (self.every_s - phase if phase else 0.0)
        if window["end_s"] is not None and window["end_s"] <= window["start_s"]:
            return None  # no drop left
        return moved.model_copy(update=window)

    @classmethod
    def trial(cls, rng: np.random.Generator, topo: Topology, low: float, high: float,
              variant: str = "") -> dict[str, Any]:
        """Drops of ``low``-``high`` ms every ``every`` seconds (the variant's
        number, default 0.2), the first at a random phase; retry as long as the drop."""
        every = float(variant[5:] or 0.2) if variant.startswith("every") else 0.2
        down = float(rng.uniform(low, high))
        return {"kind": "link_flap", "ranks": cls.pipeline_pair(rng, topo), "down_ms": down,
                "every_s": every, "start_s": float(rng.uniform(0, every)), "retry_ms": down}
