"""Everything about ``link_jitter``: each use of the link between two ranks
takes a lognormal multiple of its time (``sigma``), drawn from the link's own
seeded stream. On torch only the draws that make a transfer slower are slept
(a real link cannot be made faster)."""
from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field

from ..parallel.topology import Topology
from .protocol import Effects, Job, LinkFault, Truth

__all__ = ["LinkJitter"]


class LinkJitter(LinkFault):
    kind: Literal["link_jitter"]
    sigma: float = Field(gt=0, le=2)

    def effects(self, job: Job) -> Effects:
        return Effects(jitter=((self.pair, self.sigma),))

    def truth(self, job: Job) -> tuple[Truth, ...]:
        return (Truth("link_jitter", "link", self.ranks[0], self.ranks[1], injected=self.sigma,
                      unit="sigma"),)

    def describe(self) -> str:
        return f"{self.link_text} jittery (each transfer lognormal, sigma {self.sigma:.3g})"

    @classmethod
    def trial(cls, rng: np.random.Generator, topo: Topology, low: float, high: float,
              variant: str = "") -> dict[str, Any]:
        return {"kind": "link_jitter", "ranks": cls.pipeline_pair(rng, topo),
                "sigma": float(rng.uniform(low, high))}
