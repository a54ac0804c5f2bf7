"""All of a job's faults at once: their effects indexed by rank and link (what
an engine asks per op), the checks that concern several faults together, and
the ground truth of the job."""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..io.schema import MAX_FACTOR, MAX_SECONDS, ScenarioError
from .effects import HostDelay, Outage, Speed, Window
from .protocol import Effects, FaultSpec, Job, Pair, Truth, pair

__all__ = ["JobEffects", "LinkEffect", "check_faults", "effects_of", "ground_truth",
           "skewed_ranks"]


@dataclass(frozen=True)
class LinkEffect:
    """What the faults do to one link: a factor for the whole run, timed
    windows, jitter (lognormal sigma) and outages."""

    factor: float = 1.0
    windows: tuple[Window, ...] = ()
    sigma: float = 0.0
    outages: tuple[Outage, ...] = ()

    def delay_s(self, t: float, nominal_s: float = 0.0) -> float:
        """Seconds a transfer starting at ``t`` waits out outages."""
        return sum(o.delay_s(t, nominal_s) for o in self.outages) if self.outages else 0.0


class JobEffects:
    """The effects of every fault of a job, by rank and by link."""

    def __init__(self, effects: Effects):
        self.effects = effects
        windows: dict[int, list[Window]] = defaultdict(list)
        for rank, w in effects.compute:
            windows[rank].append(w)
        scale: dict[int, float] = defaultdict(lambda: 1.0)
        for rank, f in effects.scale:
            scale[rank] *= f
        self._speeds = {r: Speed(tuple(windows.get(r, ())), scale[r])
                        for r in set(windows) | set(scale)}
        self._host: dict[int, list[HostDelay]] = defaultdict(list)
        for rank, d in effects.host:
            self._host[rank].append(d)
        self._links = _links(effects)
        self._clocks = {rank: (offset, drift) for rank, offset, drift in effects.clocks}

    def speed(self, rank: int) -> Speed:
        return self._speeds.get(rank) or Speed()

    def host(self, rank: int) -> tuple[HostDelay, ...]:
        return tuple(self._host.get(rank, ()))

    def link(self, a: int, b: int) -> LinkEffect:
        return self._links.get(pair(a, b)) or LinkEffect()

    @property
    def has_links(self) -> bool:
        return bool(self._links)

    @property
    def timed_links(self) -> bool:
        """Some link's slowdown depends on when a use starts (a window with an
        onset, an end or a period)."""
        return any(link.windows for link in self._links.values())

    @property
    def flapping_links(self) -> bool:
        """Some link goes down (a use may wait for it)."""
        return any(link.outages for link in self._links.values())

    @property
    def stop(self) -> tuple[int, float] | None:
        """The first failure (rank, seconds), if any."""
        return min(self.effects.stops, key=lambda s: (s[1], s[0]), default=None)

    def clock(self, rank: int) -> tuple[float, float] | None:
        return self._clocks.get(rank)


def _links(effects: Effects) -> dict[Pair, LinkEffect]:
    factor: dict[Pair, float] = defaultdict(lambda: 1.0)
    timed: dict[Pair, list[Window]] = defaultdict(list)
    sigma: dict[Pair, float] = {}
    outages: dict[Pair, list[Outage]] = defaultdict(list)
    for p, w in effects.links:
        if w.steady:
            factor[p] *= w.factor
        else:
            timed[p].append(w)
    for p, s in effects.jitter:
        sigma[p] = math.hypot(sigma.get(p, 0.0), s)
    for p, o in effects.outages:
        outages[p].append(o)
    pairs = set(factor) | set(timed) | set(sigma) | set(outages)
    return {p: LinkEffect(factor[p], tuple(timed.get(p, ())), sigma.get(p, 0.0),
                          tuple(outages.get(p, ()))) for p in pairs}


def effects_of(faults: Iterable[FaultSpec], job: Job) -> JobEffects:
    total = Effects()
    for f in faults:
        total = total + f.effects(job)
    return JobEffects(total)


def ground_truth(faults: Iterable[FaultSpec], job: Job) -> tuple[Truth, ...]:
    return tuple(t for f in faults for t in f.truth(job))


def skewed_ranks(faults: Iterable[FaultSpec], job: Job) -> list[int]:
    """The ranks whose clocks the faults skew (what the aligner must undo)."""
    return [rank for f in faults for rank, _offset, _drift in f.effects(job).clocks]


def check_faults(faults: Sequence[FaultSpec], job: Job) -> None:
    """Each fault's own checks, then those of faults acting together: factors
    that act at once multiply (slow links on one link, windows that overlap on
    one rank's compute); each product stays within the sane range."""
    for i, f in enumerate(faults):
        f.check(job, f"faults[{i}]")
    links: dict[Pair, float] = defaultdict(lambda: 1.0)
    edges: dict[int, list[tuple[float, int, int, float]]] = defaultdict(list)
    for i, f in enumerate(faults):
        effects = f.effects(job)
        for p, w in effects.links:
            links[p] *= w.factor
            _check_product(i, f"slow_link factors on link {p}", links[p])
        for rank, w in effects.compute:
            end = MAX_SECONDS * 2 if w.end_s == math.inf else w.end_s
            edges[rank] += [(w.start_s, 1, i, w.factor), (end, -1, i, w.factor)]
    for rank, rank_edges in edges.items():
        product = 1.0
        for _, sign, i, factor in sorted(rank_edges):  # ends sort before starts at one instant
            product = product * factor if sign > 0 else product / factor
            _check_product(i, f"overlapping throttle factors on rank {rank}", product)


def _check_product(index: int, what: str, product: float) -> None:
    if not 1 / MAX_FACTOR <= product <= MAX_FACTOR:
        raise ScenarioError(f"faults[{index}].factor", f"{what} multiply to {product:.3g}, "
                            f"outside [{1 / MAX_FACTOR:g}, {MAX_FACTOR:g}]")
