"""The answer every detector returns, and the one signature they all share."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

from megatronapp.scan.align.inputs import ScanInput


@dataclass(frozen=True)
class RootCause:
    rank: int
    kind: Literal["compute", "host", "link"]  # its compute, its time outside ops, a link
    peer: int | None
    confidence: float  # 0..1
    evidence: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "kind": self.kind, "peer": self.peer,
                "confidence": round(self.confidence, 4), "evidence": dict(self.evidence)}


@dataclass(frozen=True)
class Diagnosis:
    root_causes: tuple[RootCause, ...] = ()  # most confident first
    victims: tuple[int, ...] = ()
    unjudged: Mapping[str, int] = field(default_factory=dict)  # kind -> suspects with no expectation
    # the rank that held most of the iterations' critical path: where time goes,
    # which is not a fault unless its peers or a model say it should take less
    bottleneck: Mapping[str, Any] = field(default_factory=dict)
    # devices and links slow throughout that cost the iterations less than a root
    # cause must (a transfer nobody waited for): not causes, shown so that they are seen
    slow_without_cost: tuple[RootCause, ...] = ()
    # ranks some of whose transfers went to a peer the trace does not give: no
    # link at them is judged (a wrong link would be named in the unknown one's place)
    links_unjudged_at: tuple[int, ...] = ()

    @property
    def healthy(self) -> bool:
        return not self.root_causes

    def to_json(self) -> dict[str, Any]:
        return {"healthy": self.healthy, "root_causes": [c.to_json() for c in self.root_causes],
                "victims": list(self.victims), "unjudged": dict(self.unjudged),
                "bottleneck": dict(self.bottleneck),
                "slow_without_cost": [c.to_json() for c in self.slow_without_cost],
                "links_unjudged_at": list(self.links_unjudged_at)}


Detector = Callable[[ScanInput], Diagnosis]


def ranked(causes: list[RootCause]) -> tuple[RootCause, ...]:
    return tuple(sorted(causes, key=lambda c: (-c.confidence, c.rank)))
