"""The one protocol every fault kind follows, and what it answers with.

A kind is a pydantic model (its scenario schema) subclassing ``FaultSpec``;
its methods say everything else about it: the checks that it touches the job,
its effects (data that the simulator and the torch backend both interpret),
its ground truth and what MegaScan should name, where it goes when the closed
loop re-plans the job, what it costs to simulate, and how validation trials
draw one. Nothing outside this package looks at a fault's kind.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from ..io.schema import OmitsUnset, Rank, ScenarioError, Seconds, StrictModel
from ..parallel.topology import Topology
from .effects import HostDelay, Outage, Window
from .peers import exchange_error

__all__ = ["Activity", "Effects", "FaultCost", "FaultSpec", "Job", "LinkFault", "Place",
           "RankFault", "Timed", "Truth", "every_kth"]

Pair = tuple[int, int]
Place = Callable[[int], "int | None"]  # a GPU's place in a re-planned job (None: gone)


def every_kth(k: int) -> str:
    """``every iteration``, ``every 3rd iteration``: how often a fault acts, in words."""
    if k == 1:
        return "every iteration"
    suffix = "th" if k % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"every {k}{suffix} iteration"


def pair(a: int, b: int) -> Pair:
    return (a, b) if a < b else (b, a)


@dataclass(frozen=True)
class Job:
    """What a fault needs to know of the job it is injected into."""

    topo: Topology  # ranks in Megatron's order (dp counts dp x cp)
    iterations: int
    entropy: tuple[int, ...]  # the scenario's seed, as SeedSequence entropy
    vpp: int = 1
    cp: int = 1
    tied_embeddings: bool = True
    devices: int | None = None  # MegaFBD: the physical devices (what a fault's rank names)
    allow_idle: bool = False  # a fault that changes nothing is accepted (allow_idle_faults)

    @property
    def world(self) -> int:
        return self.devices if self.devices is not None else self.topo.world_size

    @property
    def decoupled(self) -> bool:
        return self.devices is not None

    def rng(self, *stream: int) -> np.random.Generator:
        return np.random.default_rng([*self.entropy, *stream])

    def stream(self, *stream: int) -> tuple[int, ...]:
        return (*self.entropy, *stream)


@dataclass(frozen=True)
class Effects:
    """What faults do, as data: compute windows and constant factors per rank,
    host delays, link windows, jitter and outages per pair, stops, clocks."""

    compute: tuple[tuple[int, Window], ...] = ()
    scale: tuple[tuple[int, float], ...] = ()
    host: tuple[tuple[int, HostDelay], ...] = ()
    links: tuple[tuple[Pair, Window], ...] = ()
    jitter: tuple[tuple[Pair, float], ...] = ()
    outages: tuple[tuple[Pair, Outage], ...] = ()
    stops: tuple[tuple[int, float], ...] = ()  # (rank, when its process dies)
    clocks: tuple[tuple[int, float, float], ...] = ()  # (rank, offset_us, drift_ppm)

    def __add__(self, other: "Effects") -> "Effects":
        return Effects(*(getattr(self, f) + getattr(other, f) for f in self.__dataclass_fields__))


@dataclass(frozen=True)
class Truth:
    """One thing a fault did, as scoring reads it: what it disturbs
    (``effect``), where, when, how much, and what a detector should name."""

    kind: str  # the fault's kind
    effect: str  # compute | host | link | stop | spread | clock
    rank: int | None
    peer: int | None = None
    iterations: tuple[int, ...] | None = None  # the iterations it hits (None: all it spans)
    injected: float = 1.0  # its size: a factor, seconds
    unit: str = "x"
    name: bool = True  # a detector should name it (clock skew is the aligner's)

    @property
    def label(self) -> str:
        """``compute:5``, ``host:5``, ``link:2-7`` (lower rank first)."""
        if self.peer is None:
            return f"{self.effect}:{self.rank}"
        low, high = sorted((int(self.rank or 0), self.peer))
        return f"link:{low}-{high}"

    @property
    def should_name(self) -> str | None:
        """What MegaScan should name: ``rank 5`` or ``link 2-7``; None: nothing."""
        if not self.name or self.rank is None:
            return None
        return f"link {self.label[5:]}" if self.peer is not None else f"rank {self.rank}"

    def matches(self, kind: str, rank: int, peer: int | None) -> bool:
        """Whether a detector's cause (its kind, rank and peer) names this: the
        link for a link fault, else the rank (as compute, or any cause but a
        link for a fault that is not in its compute)."""
        if not self.name or self.rank is None:
            return False
        if self.peer is not None:
            return peer is not None and {rank, peer} == {self.rank, self.peer}
        if self.effect == "compute" and kind != "compute":
            return False
        return peer is None and rank == self.rank

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "effect": self.effect, "rank": self.rank, "peer": self.peer,
                "iterations": None if self.iterations is None else list(self.iterations),
                "injected": self.injected, "unit": self.unit, "label": self.label,
                "should_name": self.should_name}


@dataclass(frozen=True)
class FaultCost:
    """What a fault adds to simulating the job: bytes, and per rank the windows
    each of its computes is priced through."""

    bytes: float = 0.0
    windows: Mapping[int, int] = field(default_factory=dict)


class Activity(Protocol):
    """When the ranks of a finished run computed, for the checks that a
    time-windowed fault touched the job."""

    @property
    def end_s(self) -> float: ...

    def span(self, rank: int) -> tuple[float, float] | None: ...


class FaultSpec(OmitsUnset):
    """A fault kind's scenario schema and everything else about it.

    Defaults: no effect, no truth, nothing priced; a kind overrides what it has.
    ``rank`` and ``ranks`` fields name the devices it touches (checked in range).
    """

    kind: str

    def named_ranks(self) -> tuple[int, ...]:
        return ()

    def rank_field(self) -> str:
        return "rank"

    def check(self, job: Job, where: str) -> None:
        """Refuse (``ScenarioError`` naming the field) what cannot act on ``job``."""
        note = " (MegaFBD: a fault rank is a physical device)" if job.decoupled else ""
        for r in self.named_ranks():
            if not 0 <= r < job.world:
                raise ScenarioError(f"{where}.{self.rank_field()}",
                                    f"rank {r} out of range 0..{job.world - 1}{note}")

    def effects(self, job: Job) -> Effects:
        return Effects()

    def truth(self, job: Job) -> tuple[Truth, ...]:
        return ()

    def idle(self, activity: Activity, where: str) -> ScenarioError | None:
        """Why this fault changed nothing in a finished run (None: it acted)."""
        return None

    def moved(self, place: Place, elapsed_s: float) -> "FaultSpec | None":
        """This fault in the job re-planned ``elapsed_s`` into the run, its GPUs at
        ``place``; None when it is gone with them (or over)."""
        update: dict[str, Any] = {}
        rank, ranks = getattr(self, "rank", None), getattr(self, "ranks", None)
        if rank is not None:
            update["rank"] = place(rank)
        if ranks is not None:
            update["ranks"] = tuple(place(r) for r in ranks)
        if update.get("rank", 0) is None or None in update.get("ranks", ()):
            return None
        return self.model_copy(update=update)

    def cost(self, job: Job) -> FaultCost:
        return FaultCost()

    def describe(self) -> str:
        """The fault in words, for reports (a kind says it its own way)."""
        fields = self.model_dump(exclude={"kind"}, exclude_none=True)
        return f"{self.kind} ({', '.join(f'{k} {v}' for k, v in fields.items())})"

    def failure_rate_per_s(self, job: Job) -> float:
        """How often it stops the job, on average (fail-stop faults over a long job)."""
        return 0.0

    @classmethod
    def trial(cls, rng: np.random.Generator, topo: Topology, low: float, high: float,
              variant: str = "") -> dict[str, Any]:
        """A fault of this kind for a validation trial, its size in [low, high]."""
        raise ScenarioError("band", f"{cls.__name__} has no validation trials")


class RankFault(FaultSpec):
    rank: Rank

    def named_ranks(self) -> tuple[int, ...]:
        return (self.rank,)


class LinkFault(FaultSpec):
    ranks: tuple[Rank, Rank]

    def named_ranks(self) -> tuple[int, ...]:
        return self.ranks

    def rank_field(self) -> str:
        return "ranks"

    @property
    def pair(self) -> Pair:
        return pair(*self.ranks)

    @property
    def link_text(self) -> str:
        """``link 3 <-> 7``, as reports name it."""
        return f"link {self.ranks[0]} <-> {self.ranks[1]}"

    def check(self, job: Job, where: str) -> None:
        super().check(job, where)
        if self.ranks[0] == self.ranks[1]:
            raise ScenarioError(f"{where}.ranks", "a link needs two different ranks")
        if not job.allow_idle and not job.decoupled:
            reason = exchange_error(job.topo, self.ranks[0], self.ranks[1], job.vpp,
                                    job.tied_embeddings, job.cp)
            if reason is not None:
                raise ScenarioError(f"{where}.ranks", reason + " (allow_idle_faults: true "
                                    "accepts it)")

    @classmethod
    def pipeline_pair(cls, rng: np.random.Generator, topo: Topology) -> list[int]:
        """A random pipeline link (stage s to s+1) for validation trials."""
        upstream = [r for r in range(topo.world_size) if topo.coord(r).pp < topo.pp - 1]
        a = int(rng.choice(upstream))
        return [a, topo.pp_neighbor(a, 1)]


class Timed(StrictModel):
    """From ``start_s`` (simulated or wall seconds since the job began) to
    ``end_s`` (unset: to the end)."""

    start_s: Seconds = 0.0
    end_s: Seconds | None = None

    def check_window(self, where: str) -> None:
        if self.end_s is not None and self.end_s <= self.start_s:
            raise ScenarioError(f"{where}.end_s", "must be later than start_s")

    @property
    def end(self) -> float:
        return math.inf if self.end_s is None else self.end_s

    @property
    def during(self) -> str:
        """`` from 0.02 s``, `` from 0 to 0.5 s``; empty for the whole run."""
        if self.end_s is not None:
            return f" from {self.start_s:.3g} to {self.end_s:.3g} s"
        return f" from {self.start_s:.3g} s" if self.start_s else ""

    def shifted(self, elapsed_s: float) -> dict[str, Any] | None:
        """Its window ``elapsed_s`` later (a restarted job's clock starts at
        zero); None when it is over by then."""
        if self.end_s is not None and self.end_s <= elapsed_s:
            return None
        return {"start_s": max(0.0, self.start_s - elapsed_s),
                "end_s": None if self.end_s is None else self.end_s - elapsed_s}
