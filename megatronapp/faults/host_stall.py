"""Everything about ``host_stall``: the rank's host starts its work late (a
slow data loader, a garbage-collection pause, a checkpoint write, a CPU-starved
process) while its kernels run at full speed: ``seconds`` of host time before
the iteration's first forward (``before_forward``) or before its optimizer step
(``before_optimizer``), in every ``every_k_iterations``-th iteration, fixed or
lognormal around ``seconds`` (``sigma``, seeded). The time lies between two
ops: no op of the rank gets longer. On torch the rank sleeps there."""
from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field

from ..io.schema import PositiveInt
from ..parallel.topology import Topology
from .effects import HostDelay
from .protocol import Effects, Job, RankFault, Truth, every_kth
from .throttle import check_every_k, hit_iterations

__all__ = ["HostStall"]

OPS = {"before_forward": "forward", "before_optimizer": "optimizer"}
STREAM = 17  # the draws' random stream (with the rank)


class HostStall(RankFault):
    kind: Literal["host_stall"]
    seconds: float = Field(gt=0, le=1e6)
    every_k_iterations: PositiveInt = 1
    where: Literal["before_forward", "before_optimizer"] = "before_forward"
    sigma: float = Field(0.0, ge=0, le=3)  # each stall lognormal with mean ``seconds``

    def describe(self) -> str:
        spread = f" (lognormal, sigma {self.sigma:.3g})" if self.sigma else ""
        return (f"rank {self.rank}'s host stalls {self.seconds * 1e3:.3g} ms{spread} before "
                f"its {OPS[self.where]} in {every_kth(self.every_k_iterations)}")

    def check(self, job: Job, where: str) -> None:
        super().check(job, where)
        check_every_k(self.every_k_iterations, job, where)

    def delay(self, job: Job) -> HostDelay:
        return HostDelay(self.seconds, OPS[self.where], self.every_k_iterations, self.sigma,
                         job.stream(STREAM, self.rank))

    def effects(self, job: Job) -> Effects:
        return Effects(host=((self.rank, self.delay(job)),))

    def truth(self, job: Job) -> tuple[Truth, ...]:
        return (Truth("host_stall", "host", self.rank,
                      iterations=hit_iterations(self.every_k_iterations, job.iterations),
                      injected=self.seconds, unit="s"),)

    @classmethod
    def trial(cls, rng: np.random.Generator, topo: Topology, low: float, high: float,
              variant: str = "") -> dict[str, Any]:
        """``every3``: one stalled iteration in three; ``optimizer``: before the step."""
        fault: dict[str, Any] = {"kind": "host_stall", "rank": int(rng.integers(topo.world_size)),
                                 "seconds": float(rng.uniform(low, high))}
        if variant.startswith("every"):
            fault["every_k_iterations"] = int(variant[5:] or 3)
        elif variant == "optimizer":
            fault["where"] = "before_optimizer"
        return fault
