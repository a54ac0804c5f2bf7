"""Everything about ``device_variation``: every device a little different, its
compute time a seeded draw around the nominal (lognormal with ``sigma``, median
1; or normal, floored at 0.1): the straggler effect that grows with scale,
since a synchronous step waits for the slowest of more draws. On torch each
rank sleeps after each compute as its drawn factor says."""
from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field

from ..parallel.topology import Topology
from .protocol import Effects, FaultCost, FaultSpec, Job, Truth

__all__ = ["DeviceVariation"]

STREAM = 23  # the devices' draws
NORMAL_FLOOR = 0.1  # a normal draw below it would be a device faster than 10x


class DeviceVariation(FaultSpec):
    kind: Literal["device_variation"]
    sigma: float = Field(gt=0, le=1)
    distribution: Literal["lognormal", "normal"] = "lognormal"

    def describe(self) -> str:
        return f"every GPU's compute time a {self.distribution} draw, sigma {self.sigma:.3g}"

    def factors(self, job: Job) -> np.ndarray:
        """Each device's compute-time factor, in rank order."""
        z = job.rng(STREAM).standard_normal(job.world)
        if self.distribution == "normal":
            return np.maximum(1.0 + self.sigma * z, NORMAL_FLOOR)
        return np.exp(self.sigma * z)

    def effects(self, job: Job) -> Effects:
        return Effects(scale=tuple(enumerate(self.factors(job).tolist())))

    def truth(self, job: Job) -> tuple[Truth, ...]:
        """The spread names no culprit, but the slowest device is the one every
        synchronous step waits for."""
        factors = self.factors(job)
        slowest = int(np.argmax(factors))
        return (Truth("device_variation", "spread", slowest, injected=float(factors[slowest])),)

    def cost(self, job: Job) -> FaultCost:
        return FaultCost(bytes=64.0 * job.world)  # a factor, a device, its class apart

    @classmethod
    def trial(cls, rng: np.random.Generator, topo: Topology, low: float, high: float,
              variant: str = "") -> dict[str, Any]:
        return {"kind": "device_variation", "sigma": float(rng.uniform(low, high))}
