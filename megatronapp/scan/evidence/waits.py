"""Who waits for whom at synchronisation points: everything about waiting lives here.

At a collective every member waits from its own arrival until the last one
arrives, so the last arriver imposes (its arrival - each other's arrival) on
its peers. At a point-to-point transfer the receiver waits from posting its
receive until the sender sends. A rank slowed by its own work is the one its
peers wait for, in most iterations, whatever the job: DDP's bucket
all-reduces, FSDP's all-gathers, a hand-written all-reduce loop (the paper's
section 3). It needs no op of one rank matched to the same op of another.

The input is the member rows of linked sync ops as ``EventColumns`` with
each row's op id (``feed``); p2p members carry their role (0 send, 1
receive). The state is a few sums per (group, rank), per (group, iteration,
rank) and per channel (and each channel's fastest receive); rows of an op
split between two batches wait in ``pending`` until its last member arrives.
Every receive, its peer recorded or not, adds to its rank's time in
receives (``feed_receives``; ``held`` reads both for pipelines).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Literal, Mapping, Sequence, Union

import numpy as np

from megatronapp.trace.columns import KINDS, EventColumns
from megatronapp.trace.metrics import group_ids

from megatronapp.scan.diagnosis import RootCause

COLLECTIVE_KIND, P2P_KIND = KINDS.index("collective"), KINDS.index("p2p")
RECEIVE = 1  # ``columns.ROLES`` index of a receive
Group = tuple[int, ...]
Channel = tuple[int, int]  # (sender, receiver)


@dataclass(frozen=True)
class RankWaits:
    """One rank in one collective group: how often it came last and the wait it imposed."""

    rank: int
    group: Group
    joined: int  # instances of the group's collectives it joined
    last: int  # ... at which it arrived last
    imposed_s: float  # the others' summed wait for it
    group_imposed_s: float  # every member's imposed wait, summed
    iterations: int  # iterations of the group with a wait (0: no iteration recorded)
    topped: int  # ... in which it imposed more wait than any other member

    @property
    def last_share(self) -> float:
        return self.last / self.joined if self.joined else 0.0

    @property
    def imposed_share(self) -> float:
        return self.imposed_s / self.group_imposed_s if self.group_imposed_s > 0 else 0.0

    @property
    def topped_share(self) -> float:
        """Share of iterations it led, else of instances it came last to."""
        return self.topped / self.iterations if self.iterations else self.last_share


@dataclass(frozen=True)
class ChannelWaits:
    """One direction of point-to-point traffic: the receiver's wait for its sender."""

    sender: int
    receiver: int
    transfers: int
    wait_s: float  # receives posted before the send started: time the receiver waited
    delivery_s: float  # time from both sides ready to the receive's end
    fastest_receive_s: float = math.inf  # its shortest receive, posted to done


@dataclass(frozen=True)
class WaitScores:
    ranks: tuple[RankWaits, ...]
    channels: tuple[ChannelWaits, ...]
    receiving: Mapping[int, float] = field(default_factory=dict)  # rank -> s in its receives
    receives: Mapping[int, int] = field(default_factory=dict)  # rank -> its receives

    def imposed_by_sender(self) -> dict[int, float]:
        """rank -> its receivers' summed wait for its sends."""
        out: dict[int, float] = defaultdict(float)
        for c in self.channels:
            out[c.sender] += c.wait_s
        return dict(out)


@dataclass(frozen=True)
class WaitThresholds:
    """When waiting alone names a rank: its peers waited for it most in most
    iterations, and for most of all the waiting (who arrives last at a
    collective that follows another at once is a toss-up, so last arrivals
    only say who held no one up)."""

    min_iterations: int = 3  # iterations (or instances, without iterations) to judge from
    topped_share: float = 0.75  # iterations in which it imposed the most wait
    # ... or more than half of them, when it also computed this many times
    # as long as the median of its group's others; then imposing more wait
    # than any other member suffices (a peer the machine descheduled now and
    # then adds waits of its own, diluting the share without being the cause)
    busy_topped_share: float = 0.5
    busy_ratio: float = 1.3
    # ... or, with as busy a rank, in fewer iterations when over the whole
    # run the others waited this many times as long for it as for any other
    # member and it came last this many times as often (a few iterations
    # split by a loaded machine's noise say less than every instance does)
    dominance: float = 2.0
    # ... or a third of them, when it also runs its main op this many times
    # as long as its group's others even at its fastest (``best_ratio``): a
    # device that slow at its best is the cause whoever else the machine
    # held up now and then (FSDP2's rank 0 stalls after each step's last
    # reduce-scatter and comes last to most collectives)
    slow_best_topped_share: float = 1 / 3
    slow_best_ratio: float = 3.0
    # and its main op's 10th-percentile duration this many times its group's others'
    best_quantile: float = 10.0
    best_ratio: float = 1.2
    # ... in its main op, or, when the waits are all but unanimous (it came
    # last to this share of the instances and imposed this share of the
    # waiting), in any op holding ``any_op_share`` of its compute: an
    # annotated DDP step's backward holds the gradient all-reduces' overlap,
    # so a rank slowed in its forward looks busy there, not slow at its best
    unanimous_share: float = 0.9
    any_op_share: float = 1 / 3
    # a rank's fastest iterations' total of its main op (``PerIteration``) is
    # set against this quantile of the others' totals: the fastest of a few
    # iterations of a noisy job is an extreme, their typical one is not
    iteration_theirs_quantile: float = 50.0
    last_share: float = 0.5  # a rank last at fewer instances held no one up
    imposed_share: float = 0.6  # of the group's imposed wait
    min_members: int = 3  # two ranks cannot outvote each other


class WaitAccumulator:
    """Waits at sync ops, fed batch by batch (``feed``), read by ``scores``."""

    def __init__(self) -> None:
        self.joined: dict[tuple[Group, int], int] = defaultdict(int)
        self.last: dict[tuple[Group, int], int] = defaultdict(int)
        self.imposed: dict[tuple[Group, int], float] = defaultdict(float)
        self.by_iteration: dict[tuple[Group, int], dict[int, float]] = defaultdict(
            lambda: defaultdict(float))
        self.channels: dict[Channel, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, math.inf])
        self.receiving: dict[int, float] = defaultdict(float)
        self.receives: dict[int, int] = defaultdict(int)
        self.pending: _Members | None = None

    def feed(self, cols: EventColumns, op: np.ndarray) -> None:
        """Member rows of sync ops (``op``: each row's op id, one id space
        across batches); an op counts once all its members have come."""
        batch = _Members.of(cols, np.asarray(op, np.int64))
        if self.pending is not None:
            batch = self.pending.concat(batch)
        complete, self.pending = batch.split_complete()
        self._collectives(complete.take(complete.kind == COLLECTIVE_KIND))
        self._transfers(complete.take(complete.kind == P2P_KIND))

    def _collectives(self, m: "_Members") -> None:
        if not len(m.op):
            return
        order = np.lexsort((m.rank, m.start, m.op))
        m = m.take(order)
        ends = np.r_[np.flatnonzero(m.op[1:] != m.op[:-1]), len(m.op) - 1]
        latest = np.repeat(m.start[ends], np.diff(np.r_[-1, ends]))
        waits = np.add.reduceat(latest - m.start, np.r_[0, ends[:-1] + 1])
        last = m.take(ends)
        for (group, rank), n, wait in _tallies([last.group, last.rank], waits):
            self.last[(m.groups[group], rank)] += n
            self.imposed[(m.groups[group], rank)] += wait
        known = last.iteration >= 0
        for (group, it, rank), _, wait in _tallies(
                [last.group[known], last.iteration[known], last.rank[known]], waits[known]):
            self.by_iteration[(m.groups[group], it)][rank] += wait
        for (group, rank), n, _ in _tallies([m.group, m.rank], np.zeros(len(m.op))):
            self.joined[(m.groups[group], rank)] += n

    def _transfers(self, m: "_Members") -> None:
        if not len(m.op):
            return
        order = np.lexsort((m.role, m.op))
        send, recv = m.take(order[0::2]), m.take(order[1::2])
        ready = np.maximum(send.start, recv.start)
        waits = np.maximum(send.start - recv.start, 0.0)
        deliveries = np.maximum(recv.end - ready, 0.0)
        for s, r, w, d, took in zip(send.rank.tolist(), recv.rank.tolist(), waits.tolist(),
                                    deliveries.tolist(), (recv.end - recv.start).tolist()):
            acc = self.channels[(s, r)]
            acc[0] += 1
            acc[1] += w
            acc[2] += d
            acc[3] = min(acc[3], took)

    def feed_receives(self, cols: EventColumns) -> None:
        """Every receive of a batch (``cols``: its rows), its peer recorded
        or not: the time each rank spent in them, and how many it posted."""
        rows = receive_rows(cols)
        for rank, seconds in zip(*_summed_by(cols.rank[rows], cols.dur_s[rows])):
            self.receiving[rank] += seconds
        for rank, count in zip(*np.unique(cols.rank[rows].astype(np.int64), return_counts=True)):
            self.receives[int(rank)] += int(count)

    def mirrored(self, offsets: Callable[[int], Sequence[int]],
                 inside: Callable[[Group], bool]) -> "WaitAccumulator":
        """What every rank's twin would have added: each entry of a group
        that ``inside`` says stays in one replica, and each channel and
        rank, once per twin, moved by its offset (``offsets(rank)``, 0
        first); the entries of groups that join replicas are every rank's
        already and stay as they are."""
        out = WaitAccumulator()
        for tally in ("joined", "last", "imposed"):
            into = getattr(out, tally)
            for (group, rank), value in getattr(self, tally).items():
                for off in offsets(rank) if inside(group) else (0,):
                    into[(_moved(group, off), rank + off)] = value
        for (group, it), by_rank in self.by_iteration.items():
            for off in offsets(group[0]) if inside(group) else (0,):
                out.by_iteration[(_moved(group, off), it)].update(
                    (r + off, w) for r, w in by_rank.items())
        for (sender, receiver), acc in self.channels.items():
            for off in offsets(sender):
                out.channels[(sender + off, receiver + off)] = list(acc)
        for rank, seconds in self.receiving.items():
            for off in offsets(rank):
                out.receiving[rank + off] = seconds
        out.pending = self.pending
        return out

    def scores(self) -> WaitScores:
        totals: dict[Group, float] = defaultdict(float)
        for (group, _), imposed in self.imposed.items():
            totals[group] += imposed
        iterations, topped = self._iterations_led()
        ranks = tuple(RankWaits(rank, group, n, self.last.get((group, rank), 0),
                                self.imposed.get((group, rank), 0.0), totals[group],
                                iterations.get(group, 0), topped.get((group, rank), 0))
                      for (group, rank), n in sorted(self.joined.items()))
        channels = tuple(ChannelWaits(s, r, int(n), w, d, fastest)
                         for (s, r), (n, w, d, fastest) in sorted(self.channels.items()))
        return WaitScores(ranks, channels, dict(self.receiving), dict(self.receives))

    def _iterations_led(self) -> tuple[dict[Group, int], dict[tuple[Group, int], int]]:
        """Per group, its iterations with a wait; per (group, rank), those it led."""
        iterations: dict[Group, int] = defaultdict(int)
        topped: dict[tuple[Group, int], int] = defaultdict(int)
        for (group, _), by_rank in self.by_iteration.items():
            if not by_rank:
                continue
            iterations[group] += 1
            leader = max(sorted(by_rank), key=lambda r: by_rank[r])
            topped[(group, leader)] += 1
        return iterations, topped


def _moved(group: Group, offset: int) -> Group:
    return tuple(r + offset for r in group) if offset else group


def receive_rows(cols: EventColumns) -> np.ndarray:
    """Rows of point-to-point receives: by their role, else (a trace that
    records none, Kineto's) by their name."""
    named = np.array(["recv" in n.lower() for n in cols.names] + [False])
    by_name = (cols.role < 0) & named[cols.name.astype(np.int64)]
    return np.flatnonzero((cols.kind == P2P_KIND) & ((cols.role == RECEIVE) | by_name))


def _summed_by(keys: np.ndarray, values: np.ndarray) -> tuple[list[int], list[float]]:
    """The distinct ``keys`` and the summed ``values`` of each."""
    distinct, which = np.unique(keys.astype(np.int64), return_inverse=True)
    return distinct.tolist(), np.bincount(which, values, minlength=len(distinct)).tolist()


def _tallies(keys: list[np.ndarray], weights: np.ndarray
             ) -> list[tuple[tuple[int, ...], int, float]]:
    """Per distinct tuple of ``keys`` (row-aligned): the tuple, its rows and
    their summed ``weights`` (one pass, however many ops a batch holds)."""
    ids, n = group_ids(*keys)
    if not n:
        return []
    first = np.unique(ids, return_index=True)[1]
    counts, sums = np.bincount(ids, minlength=n), np.bincount(ids, weights, minlength=n)
    return [(tuple(int(k[f]) for k in keys), int(c), float(w))
            for f, c, w in zip(first.tolist(), counts.tolist(), sums.tolist())]


@dataclass(frozen=True)
class _Members:
    """Member rows reduced to what waiting needs, with each op's expected size."""

    op: np.ndarray
    rank: np.ndarray
    kind: np.ndarray
    role: np.ndarray
    group: np.ndarray  # index into ``groups`` (-1 for p2p)
    iteration: np.ndarray
    start: np.ndarray
    end: np.ndarray
    size: np.ndarray  # members the op has
    groups: tuple[Group, ...]

    @staticmethod
    def of(cols: EventColumns, op: np.ndarray) -> "_Members":
        groups = tuple(tuple(sorted(g)) for g in cols.groups)
        sizes = np.array([len(g) for g in groups] + [2], np.int64)
        group = cols.group.astype(np.int64)
        return _Members(op, cols.rank.astype(np.int64), cols.kind.astype(np.int64),
                        cols.role.astype(np.int64), group, cols.iteration.astype(np.int64),
                        cols.start_s, cols.end_s, np.where(cols.kind == P2P_KIND, 2,
                                                           sizes[group]), groups)

    def take(self, index: np.ndarray) -> "_Members":
        return replace(self, **{f: getattr(self, f)[index] for f in _MEMBER_ARRAYS})

    def concat(self, other: "_Members") -> "_Members":
        """Both batches' rows, ``other``'s groups re-coded into one table."""
        groups = tuple(dict.fromkeys(self.groups + other.groups))
        recode = np.array([groups.index(g) for g in other.groups] + [-1], np.int64)
        other = replace(other, group=recode[other.group], groups=groups)
        return replace(self, groups=groups, **{
            f: np.concatenate([getattr(self, f), getattr(other, f)]) for f in _MEMBER_ARRAYS})

    def split_complete(self) -> tuple["_Members", "_Members | None"]:
        """(rows of ops with every member here, the rest or None)."""
        ids, which, counts = np.unique(self.op, return_inverse=True, return_counts=True)
        complete = counts[which] >= self.size
        rest = self.take(~complete)
        return self.take(complete), (rest if len(rest.op) else None)


_MEMBER_ARRAYS = ("op", "rank", "kind", "role", "group", "iteration", "start", "end", "size")


# -------------------------------------------------------------- verdict
Samples = Union[Sequence[float], np.ndarray]
Compute = Mapping[int, Mapping[str, Samples]]  # rank -> op name -> its compute durations


@dataclass(frozen=True)
class PerIteration:
    """Each rank's ops totalled per whole iteration (``iteration_totals``),
    read only in a group of stage peers (``peers``: rank -> the ranks doing
    its work): in one that joins pipeline stages the first stage's forward
    holds the embedding, and its totals are not its peers'."""

    totals: Compute = field(default_factory=dict)
    peers: Mapping[int, Sequence[int]] = field(default_factory=dict)

    def best(self, w: RankWaits, th: WaitThresholds) -> tuple[str, float]:
        """(its main op, its fastest iterations' total of it over the
        others' typical iteration's), or ("", 0) outside a group of stage
        peers."""
        if not set(w.group) <= set(self.peers.get(w.rank, ())):
            return "", 0.0
        # a few iterations: the quantile is a sample, not a blend of the fastest two
        return next(_op_best_ratios(w.rank, w.group, self.totals, th.best_quantile, "lower",
                                    th.iteration_theirs_quantile), ("", 0.0))


def waited_for(scores: WaitScores, compute: Compute = {},
               th: WaitThresholds = WaitThresholds(), per_iteration: PerIteration = PerIteration()
               ) -> list[RankWaits]:
    """Ranks their peers waited for most in most iterations of a group, for
    most of its waiting, or in more than half of them, for more of the
    waiting than for any other member, while it computed far longer than
    the group's others (``compute``: rank -> op name -> its compute
    durations) or, so busy, in fewer of them when over the whole run the
    others waited far longer for it and it came last far more often than
    any other member (``dominance``), or in a third of them while it
    computed far longer and was far slower at its best; either way slow at
    its best in its main work (the op it spends most time in, against the
    same op on the group's others): a process the machine only descheduled
    is late and busy, not slow at its fastest. ``per_iteration``: its ops'
    totals over whole iterations, a second reading of its best that layers
    of different shapes do not blur."""
    most = _imposed_most(scores)
    dominant = _dominant(scores, th.dominance)
    out = []
    for w in scores.ranks:
        if len(w.group) < th.min_members or (w.iterations or w.joined) < th.min_iterations:
            continue
        by_waits = w.imposed_share >= th.imposed_share and w.topped_share >= th.topped_share
        busier = ((w.topped_share > th.busy_topped_share and (w.group, w.rank) in most)
                  or (w.group, w.rank) in dominant)
        if not (by_waits or busier or w.topped_share >= th.slow_best_topped_share):
            continue
        if not by_waits and _busy_ratio(w, compute) < th.busy_ratio:
            continue  # the other two ways need it to have computed far longer
        _, best, _ = _best_for(w, compute, th, per_iteration)
        if best >= th.best_ratio and (by_waits or busier or best >= th.slow_best_ratio):
            out.append(w)
    return out


def _imposed_most(scores: WaitScores) -> set[tuple[Group, int]]:
    """(group, rank) of each group's member that imposed more wait than any other."""
    return _tops(scores, lambda top, w: w.imposed_s < top.imposed_s)


def _dominant(scores: WaitScores, factor: float) -> set[tuple[Group, int]]:
    """(group, rank) of each group's member the others waited ``factor``
    times as long for as for any other member, and that came last
    ``factor`` times as often as any other."""
    return _tops(scores, lambda top, w: (top.imposed_s >= factor * w.imposed_s
                                         and top.last >= factor * w.last))


def _tops(scores: WaitScores, beats: Callable[[RankWaits, RankWaits], bool]
          ) -> set[tuple[Group, int]]:
    """(group, rank) of each group's member that imposed the most wait, when
    it ``beats`` every other member."""
    by_group: dict[Group, list[RankWaits]] = defaultdict(list)
    for w in scores.ranks:
        by_group[w.group].append(w)
    out = set()
    for group, members in by_group.items():
        top = max(members, key=lambda w: w.imposed_s)
        if top.imposed_s > 0 and all(beats(top, w) for w in members if w is not top):
            out.add((group, top.rank))
    return out


def _busy_ratio(w: RankWaits, compute: Compute) -> float:
    """Its summed compute over the median of its group's others'."""
    busy = {r: float(sum(np.sum(v) for v in compute[r].values())) for r in w.group if r in compute}
    others = [b for r, b in busy.items() if r != w.rank]
    centre = float(np.median(others)) if others else 0.0
    return busy.get(w.rank, 0.0) / centre if centre > 0 else 0.0


def best_ratio(rank: int, group: Sequence[int], compute: Compute, quantile: float) -> float:
    """The ``quantile`` of ``rank``'s durations of its main op (the one it
    spends most time in that others of ``group`` run too) over the median of
    theirs; 0 when no such op."""
    return next((ratio for _, ratio in _op_best_ratios(rank, group, compute, quantile)), 0.0)


def _op_best_ratios(rank: int, group: Sequence[int], compute: Compute, quantile: float,
                    method: Literal["linear", "lower"] = "linear",
                    theirs_quantile: float | None = None) -> Iterator[tuple[str, float]]:
    """(op name, the ``quantile`` of ``rank``'s durations over the median of
    the same quantile, or ``theirs_quantile``, on the others of ``group``)
    for each op they run too, the op it spends most time in first (lazily:
    the main op alone needs one); ``method``: numpy's, how the quantile
    falls between samples."""
    def at(values: Samples, q: float) -> float:
        return float(np.percentile(values, q, method=method))

    q_theirs = quantile if theirs_quantile is None else theirs_quantile
    mine = compute.get(rank, {})
    for name in sorted(mine, key=lambda n: -float(np.sum(mine[n]))):
        theirs = [at(compute[r][name], q_theirs) for r in group
                  if r != rank and r in compute and len(compute[r].get(name, ())) > 0]
        if theirs and len(mine[name]) > 0 and np.median(theirs) > 0:
            yield name, at(mine[name], quantile) / float(np.median(theirs))


def _best_for(w: RankWaits, compute: Compute, th: WaitThresholds,
              per_iteration: PerIteration = PerIteration()) -> tuple[str, float, str]:
    """How slow ``w``'s rank is at its best, in which op and by what reading:
    its main op's fastest calls ("call") or its fastest iterations' totals
    of that op ("iteration"), or, the waits all but unanimous, the slowest
    of its ops that hold ``any_op_share`` of its compute ("", 0 and "call"
    when it shares no op)."""
    ratios = _op_best_ratios(w.rank, w.group, compute, th.best_quantile)
    main = next(ratios, ("", 0.0))
    by_iteration = per_iteration.best(w, th)
    held: list[tuple[str, float]] = []
    if min(w.last_share, w.imposed_share) >= th.unanimous_share:
        mine = compute.get(w.rank, {})
        total = sum(float(np.sum(v)) for v in mine.values())
        held = [(n, r) for n, r in ratios if float(np.sum(mine[n])) >= th.any_op_share * total]
    op, ratio = max([main, *held], key=lambda o: o[1])
    if by_iteration[1] > ratio:
        return by_iteration[0], by_iteration[1], "iteration"
    return op, ratio, "call"


def with_waits(causes: Sequence[RootCause], scores: WaitScores, compute: Compute = {},
               th: WaitThresholds = WaitThresholds(),
               per_iteration: PerIteration = PerIteration()) -> list[RootCause]:
    """The detector's causes weighed with who waited for whom. A rank the
    waits name (``waited_for``) is a compute root cause, on the waits alone
    when nothing else names it, unless a named link of its own explains its
    lateness; a compute candidate of a group whose waits name another rank,
    and that rarely came last there, held no one up and is dropped. Every
    compute cause says which evidence it rests on. ``compute``: rank -> op
    name -> its compute durations; ``per_iteration``: the same, totalled per
    whole iteration, with the stage peers they compare among."""
    named = {w.rank: w for w in waited_for(scores, compute, th, per_iteration)}
    linked = {r for c in causes if c.kind == "link" for r in (c.rank, c.peer)}
    named = {r: w for r, w in named.items() if r not in linked}
    out = []
    for c in causes:
        if c.kind != "compute":
            out.append(c)
        elif c.rank in named:
            w = named.pop(c.rank)
            out.append(replace(c, confidence=max(c.confidence, _confidence(w)),
                               evidence={**c.evidence,
                                         **_evidence(w, compute, th, per_iteration),
                                         "rests_on": ["compute", "waits"]}))
        elif not _outwaited(c.rank, scores, named, th):
            out.append(replace(c, evidence={**c.evidence, "rests_on": ["compute"]}))
    return out + [RootCause(w.rank, "compute", None, _confidence(w),
                            {**_evidence(w, compute, th, per_iteration),
                             "rests_on": ["waits"]})
                  for w in named.values()]


def _outwaited(rank: int, scores: WaitScores, named: Mapping[int, RankWaits],
               th: WaitThresholds) -> bool:
    """In a group whose waits name another rank, ``rank`` rarely came last."""
    groups = {w.group for w in named.values()}
    return any(w.rank == rank and w.group in groups and w.last_share < th.last_share
               for w in scores.ranks)


def _confidence(w: RankWaits) -> float:
    return (w.topped_share + w.imposed_share) / 2


def _evidence(w: RankWaits, compute: Compute, th: WaitThresholds,
              per_iteration: PerIteration) -> dict[str, object]:
    best_op, best, best_by = _best_for(w, compute, th, per_iteration)
    return {"waited_for": {"group": list(w.group), "last": w.last, "joined": w.joined,
                           "imposed_s": round(w.imposed_s, 6),
                           "imposed_share": round(w.imposed_share, 3),
                           "iterations_led": w.topped, "iterations": w.iterations,
                           "busy_ratio": round(_busy_ratio(w, compute), 3),
                           "best_op": best_op, "best_ratio": round(best, 3),
                           "best_by": best_by}}
