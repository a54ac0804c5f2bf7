"""The cross-rank dependency graph of a trace and its critical path.

Nodes are the start and end instants of every event, plus one node per
collective instance. Edges say "cannot happen before":

- an event's start -> its end, weighted by the work it stands for: a compute's
  or a send's duration; zero for a matched receive or collective member
  (their time is waiting, accounted for by the edges below) and for
  annotations;
- program order on each rank: the end of the event that finished last before
  another started -> that event's start;
- a send's start -> its matched receive's end, weighted by the transfer (post
  to delivery);
- every member's start -> the collective -> every member's end, weighted by the
  time from the last arrival to that member's end.

Every weight is at most the time between its two instants (an edge back in
time within ``TOLERANCE_S``, timestamp rounding, weighs that negative time),
so the longest path (by weight) is at most the trace's window; what it falls
short of is waiting nothing in the trace explains. Edges only point forward in
time (within the tolerance), so the graph is acyclic; a cycle left by clock
misalignment is broken by dropping one of its cross-rank edges.
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import networkx as nx

from megatronapp.host.gc_pause import paused_gc
from megatronapp.trace.kinds import EventKind, event_kind
from megatronapp.trace.events import Event

from megatronapp.scan.ingest.deps import SyncOp
from megatronapp.scan.ingest.load import RankEvents

TOLERANCE_S = 1e-9  # timestamps are written in µs with 3 decimals
Node = int  # see Nodes


@dataclass(frozen=True)
class PathStep:
    """One event's share of the critical path."""

    rank: int
    name: str
    kind: EventKind
    start_s: float
    seconds: float
    args: Any

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "name": self.name, "kind": self.kind,
                "start_s": self.start_s, "seconds": self.seconds,
                **{k: self.args[k] for k in ("iteration", "microbatch", "chunk") if k in self.args}}


@dataclass(frozen=True)
class CriticalPath:
    steps: tuple[PathStep, ...]  # the path's events that carry time, in order
    length_s: float  # the path's weight (ties within the tolerance count negative)
    window_start_s: float  # first start over all ranks
    window_s: float  # first start to last end over all ranks

    def by_rank(self) -> dict[int, float]:
        return _totals((s.rank, s.seconds) for s in self.steps)

    def by_kind(self) -> dict[str, float]:
        return _totals((s.kind, s.seconds) for s in self.steps)

    def to_json(self) -> dict[str, Any]:
        return {"length_s": self.length_s, "window_start_s": self.window_start_s,
                "window_s": self.window_s,
                "by_rank": {str(r): t for r, t in self.by_rank().items()},
                "by_kind": self.by_kind(), "ops": [s.to_json() for s in self.steps]}


def _totals(pairs: Iterable[tuple[Any, float]]) -> dict[Any, float]:
    totals: dict[Any, float] = defaultdict(float)
    for key, seconds in pairs:
        totals[key] += seconds
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


# ------------------------------------------------------------------ graph
Edge = tuple[Node, Node, dict[str, Any]]


class Nodes:
    """Integer node ids (cheap to hash): event ``g`` (counted over the ranks
    in order) starts at ``2g`` and ends at ``2g + 1``; collectives are negative."""

    def __init__(self, events: RankEvents):
        self.base: dict[int, int] = {}
        self.event: list[tuple[int, int]] = []  # g -> (rank, index)
        for rank, rank_events in events.items():
            self.base[rank] = len(self.event)
            self.event += [(rank, i) for i in range(len(rank_events))]

    def start(self, rank: int, index: int) -> int:
        return 2 * (self.base[rank] + index)

    def end(self, rank: int, index: int) -> int:
        return 2 * (self.base[rank] + index) + 1

    def of(self, node: int) -> tuple[int, int]:
        """(rank, index) of an event's start or end node."""
        return self.event[node // 2]


def _program_order(ids: Nodes, rank: int, events: Sequence[Event]) -> Iterator[Edge]:
    """Each event waits for the latest event that ended before it started."""
    ended: list[tuple[float, int]] = []  # heap of (end, index) not yet known to precede
    latest: tuple[float, int] | None = None
    for index in sorted(range(len(events)), key=lambda i: (events[i].start_s, i)):
        e = events[index]
        while ended and ended[0][0] <= e.start_s + TOLERANCE_S:
            done = heapq.heappop(ended)
            latest = done if latest is None or done[0] > latest[0] else latest
        if latest is not None:  # a tie within the tolerance never adds time
            yield (ids.end(rank, latest[1]), ids.start(rank, index),
                   {"weight": min(0.0, e.start_s - latest[0])})
        heapq.heappush(ended, (e.end_s, index))


def _cross(src: Node, dst: Node, seconds: float) -> Iterator[Edge]:
    if seconds >= -TOLERANCE_S:  # never backwards in time (misaligned clocks)
        yield src, dst, {"weight": seconds, "cross": True}


def _sync_edges(ids: Nodes, events: RankEvents, ops: Iterable[SyncOp],
                linked: set[tuple[int, int]]) -> Iterator[Edge]:
    """Send -> receive and collective edges; adds the members they explain to ``linked``."""
    collectives = 0
    for op in ops:
        if op.kind == "p2p":
            (s, si), (r, ri) = op.members
            send, recv = events[s][si], events[r][ri]
            yield from _cross(ids.start(s, si), ids.end(r, ri),
                              min(send.end_s, recv.end_s) - send.start_s)
            linked.add((r, ri))
        elif len(op.members) > 1:
            last = max(events[r][i].start_s for r, i in op.members)
            collectives += 1
            for r, i in op.members:
                yield ids.start(r, i), -collectives, {"weight": 0.0, "cross": True}
                yield from _cross(-collectives, ids.end(r, i), events[r][i].end_s - last)
                linked.add((r, i))


def _work_edges(ids: Nodes, rank: int, events: Sequence[Event], linked: set[tuple[int, int]]
                ) -> Iterator[Edge]:
    for index, e in enumerate(events):
        explained = (rank, index) in linked or event_kind(e.name, e.args) == "other"
        yield (ids.start(rank, index), ids.end(rank, index),
               {"weight": 0.0 if explained else e.dur_s})


def dependency_graph(events: RankEvents, ops: Iterable[SyncOp]) -> nx.DiGraph:
    """The graph described in this module's docstring (acyclic); its ``ids``
    (``Nodes``) and a topological ``order`` are in ``graph.graph``."""
    ids = Nodes(events)
    graph = nx.DiGraph(ids=ids)
    linked: set[tuple[int, int]] = set()
    with paused_gc():
        graph.add_edges_from(list(_sync_edges(ids, events, ops, linked)))
        for rank, rank_events in events.items():
            graph.add_edges_from(_work_edges(ids, rank, rank_events, linked))
            graph.add_edges_from(_program_order(ids, rank, rank_events))
        graph.graph["order"] = _acyclic_order(graph)
    return graph


def _acyclic_order(graph: nx.DiGraph) -> list[Node]:
    """A topological order, after breaking each cycle (clock misalignment
    left it) at one of its cross-rank edges."""
    while True:
        try:
            return list(nx.topological_sort(graph))
        except nx.NetworkXUnfeasible:
            cycle = nx.find_cycle(graph)
            src, dst = next(((u, v) for u, v in cycle if graph.edges[u, v].get("cross")),
                            cycle[0])
            graph.remove_edge(src, dst)


# ------------------------------------------------------------------ path
def _step(events: RankEvents, ids: Nodes, src: int, dst: int, seconds: float) -> PathStep:
    """The event a weighted edge of the path stands for: the event (or send)
    it starts from, or for a collective the member it ends."""
    rank, index = ids.of(dst if src < 0 else src)
    e = events[rank][index]
    return PathStep(rank, e.name, event_kind(e.name, e.args), e.start_s, seconds, e.args)


def critical_path(events: RankEvents, ops: Iterable[SyncOp]) -> CriticalPath:
    """The longest chain of work through the trace (see the module docstring)."""
    starts = [e.start_s for ev in events.values() for e in ev]
    if not starts:
        return CriticalPath((), 0.0, 0.0, 0.0)
    first = min(starts)
    window = max(e.end_s for ev in events.values() for e in ev) - first
    graph = dependency_graph(events, ops)
    with paused_gc():
        path = nx.dag_longest_path(graph, weight="weight", default_weight=0.0,
                                   topo_order=graph.graph["order"])
    weights = [(u, v, graph.edges[u, v]["weight"]) for u, v in zip(path, path[1:])]
    steps = tuple(_step(events, graph.graph["ids"], u, v, w) for u, v, w in weights if w > 0)
    return CriticalPath(steps, sum(w for _, _, w in weights), first, window)
