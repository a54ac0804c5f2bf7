"""Static rank programs compiled into flat operation arrays, per pipeline stage.

The rank programs (generators) stay the one source of truth: compiling runs
each program of one pipeline (one dp/tp slice) against a recording
interpreter that answers every operation at once. A program whose operations
do not depend on what it is answered (every static schedule) yields the same
sequence on any backend, so that sequence *is* the program. ``WaitAny`` (a
dynamic policy choosing by what has completed), point-to-point traffic that
leaves the pipeline, collectives on groups other than the rank's own TP, DP,
model-parallel or embedding group and trace arguments other than plain
values make a program not static (``NotStatic``): it keeps the generator
path. Asynchronous collectives (overlapped gradient reduction and parameter
gathering) compile to a post (``ASYNC_COLLECTIVE``) and a later wait on it
(``COLLECTIVE_WAIT``); collectives on one communicator run one after
another, as on the SimPy path.

The compiled form names no global rank: peers are pipeline stages, groups are
kinds (tp, dp, mp), messages are indices into the pipeline's message table.
Every pipeline of a job therefore compiles to the same ``PipeProgram``
(tested over random jobs), and one compiled pipeline stands for all of them.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Hashable, Iterator, Sequence

import numpy as np
from numba import njit

from ..trace.columns import KINDS, ROLES, EventColumns, concat_same
from ..parallel.ops import (AllGather, AllReduce, Compute, IRecv, ISend, Op, RankProgram, Recv,
                  ReduceScatter, Send, Wait, WaitAny, encode_tag)
from ..parallel.topology import Group, Topology

# Operation codes of the flat arrays.
COMPUTE, SEND, RECV, WAIT, COLLECTIVE, RECV_WAIT, ASYNC_COLLECTIVE, COLLECTIVE_WAIT = range(8)
GROUP_KINDS = ("tp", "dp", "mp", "emb")  # emb: first and last stage (tied embeddings)
META_KEYS = ("iteration", "microbatch", "chunk")


class NotStatic(Exception):
    """A rank program that cannot be compiled; it runs on the generator path."""


@dataclass(frozen=True)
class _Handle:
    op_index: int


@dataclass(frozen=True)
class StageProgram:
    """One stage's operations and the static fields of the events they record.

    ops: (COMPUTE, event, cost_s) | (SEND, event, message, nbytes) |
    (RECV, event, message) | (WAIT, message) | (RECV_WAIT, event, message) |
    (COLLECTIVE, event, group kind, nbytes, n-th collective of that kind, ring passes) |
    (ASYNC_COLLECTIVE, the same fields) | (COLLECTIVE_WAIT, event of the posted
    collective, its group kind).
    A RECV only posts the receive (IRecv); a WAIT on its message blocks;
    RECV_WAIT is both at once (Recv); an ASYNC_COLLECTIVE joins its collective
    without waiting for it, a COLLECTIVE_WAIT waits until it has ended.
    """

    ops: tuple[tuple[Any, ...], ...]
    names: tuple[str, ...]  # per event
    iteration: tuple[int, ...]  # per event, -1 if absent (same for the next fields)
    microbatch: tuple[int, ...]
    chunk: tuple[int, ...]
    nbytes: tuple[int, ...]
    peer_stage: tuple[int, ...]
    group_kind: tuple[int, ...]
    op_kind: tuple[int, ...]  # codes into columns.KINDS
    role: tuple[int, ...]  # codes into columns.ROLES
    tag: tuple[int, ...]  # ops.encode_tag
    extra: tuple[str | None, ...]  # JSON of the other trace arguments (columns.EventColumns.extra)

    @property
    def events(self) -> int:
        return len(self.names)


@dataclass(frozen=True)
class PipeProgram:
    stages: tuple[StageProgram, ...]
    messages: tuple[tuple[int, int], ...]  # message -> (sender stage, receiver stage)

    @property
    def events_per_pipe(self) -> int:
        return sum(st.events for st in self.stages)

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(n for st in self.stages for n in st.names))

    @cached_property
    def static_fields(self) -> list[dict[str, np.ndarray]]:
        """Per stage, the event fields as arrays (names as codes)."""
        code = {n: i for i, n in enumerate(self.names)}
        out: list[dict[str, np.ndarray]] = []
        for st in self.stages:
            peer = np.asarray(st.peer_stage, np.int64)
            out.append({"name": np.asarray([code[n] for n in st.names], np.int16),
                        "kind": np.asarray(st.op_kind, np.int8),
                        "role": np.asarray(st.role, np.int8), "tag": np.asarray(st.tag, np.int64),
                        "iteration": np.asarray(st.iteration, np.int32),
                        "microbatch": np.asarray(st.microbatch, np.int32),
                        "chunk": np.asarray(st.chunk, np.int32),
                        "nbytes": np.asarray(st.nbytes, np.int64), "peer_stage": peer,
                        "group_kind": np.asarray(st.group_kind, np.int64),
                        "extra": np.asarray(st.extra, object)})
        return out

    @cached_property
    def has_extra(self) -> bool:
        """Whether any event carries trace arguments beyond the columns."""
        return any(x is not None for st in self.stages for x in st.extra)


def record(program: RankProgram) -> list[Op]:
    """Every operation of a program that never looks at what it is answered."""
    ops: list[Op] = []
    answer: Any = None
    while True:
        try:
            op = program.send(answer)
        except StopIteration:
            return ops
        if isinstance(op, WaitAny):
            program.close()
            raise NotStatic("WaitAny: the program chooses by what has completed")
        ops.append(op)
        waitable = type(op) in (ISend, IRecv) or (isinstance(op, AllReduce) and op.async_op)
        answer = _Handle(len(ops) - 1) if waitable else None


def group_kind(topo: Topology, rank: int, group: Group) -> int:
    own = tuple(kind_group(topo, kind, rank) for kind in range(len(GROUP_KINDS)))
    for kind, candidate in enumerate(own):
        if tuple(group) == candidate:
            return kind
    raise NotStatic(f"rank {rank}: collective on {list(group)} is not one of its own groups")


def kind_group(topo: Topology, kind: int, rank: int) -> Group:
    if kind == 0:
        return topo.tp_group(rank)
    if kind == 3:
        return embedding_group(topo.pp_group(rank))
    return topo.dp_group(rank) if kind == 1 else topo.model_parallel_group(rank)


def embedding_group(pipeline: Group) -> Group:
    """The group that reduces tied embeddings: a pipeline's first and last stage."""
    return (pipeline[0], pipeline[-1])


def _meta(op: Any) -> tuple[int, int, int, str | None]:
    """The meta's column values, and its other arguments as JSON (as the event
    table keeps them); arguments JSON would not give back unchanged keep the
    generator path."""
    other = {k: v for k, v in op.meta.items() if k not in META_KEYS}
    if any(type(v) not in (int, float, str, bool, type(None)) for v in other.values()):
        raise NotStatic(f"trace arguments {sorted(other)} are not plain values")
    it, mb, chunk = (int(op.meta.get(k, -1)) for k in META_KEYS)
    return it, mb, chunk, (json.dumps(other) if other else None)


class _StageBuilder:
    def __init__(self) -> None:
        self.ops: list[tuple[Any, ...]] = []
        self.fields: dict[str, list[Any]] = defaultdict(list)
        self.posted: dict[int, tuple[int, int]] = {}  # async collective's op index -> (event, kind)

    def event(self, name: str, op: Any, nbytes: int = -1, peer: int = -1, kind: int = -1) -> int:
        it, mb, chunk, extra = _meta(op)
        p2p = isinstance(op, (ISend, IRecv))
        for key, value in (("names", name), ("iteration", it), ("microbatch", mb),
                           ("chunk", chunk), ("nbytes", nbytes), ("peer_stage", peer),
                           ("group_kind", kind), ("op_kind", KINDS.index(op.kind)),
                           ("role", ROLES.index(op.role) if p2p else -1),
                           ("tag", encode_tag(op.tag) if p2p else -1), ("extra", extra)):
            self.fields[key].append(value)
        return len(self.fields["names"]) - 1

    def build(self) -> StageProgram:
        return StageProgram(tuple(self.ops), **{k: tuple(self.fields[k]) for k in (
            "names", "iteration", "microbatch", "chunk", "nbytes", "peer_stage", "group_kind",
            "op_kind", "role", "tag", "extra")})


def _messages(recorded: Sequence[list[Op]], ranks: Sequence[int]) -> dict[tuple[int, int], int]:
    """(stage, op index) of every send and receive -> message number; the n-th
    send on (src, dst, tag) meets the n-th receive on it, as in the mailbox."""
    stage_of = {r: s for s, r in enumerate(ranks)}
    sides: dict[tuple[int, int, Hashable], list[list[tuple[int, int]]]] = defaultdict(
        lambda: [[], []])
    for stage, ops in enumerate(recorded):
        for i, op in enumerate(ops):
            if isinstance(op, ISend):
                if op.dst not in stage_of:
                    raise NotStatic(f"rank {ranks[stage]} sends outside its pipeline")
                sides[(ranks[stage], op.dst, op.tag)][0].append((stage, i))
            elif isinstance(op, IRecv):
                if op.src not in stage_of:
                    raise NotStatic(f"rank {ranks[stage]} receives from outside its pipeline")
                sides[(op.src, ranks[stage], op.tag)][1].append((stage, i))
    number: dict[tuple[int, int], int] = {}
    for sends, recvs in sides.values():
        if len(sends) != len(recvs):
            raise NotStatic("a send without its receive (or the reverse)")
        for send, recv in zip(sends, recvs):
            number[send] = number[recv] = len(number) // 2
    return number


def compile_pipe(programs: Sequence[RankProgram], ranks: Sequence[int], topo: Topology) -> PipeProgram:
    """Compile the programs of one pipeline, ``programs[stage]`` run by ``ranks[stage]``."""
    recorded = [record(p) for p in programs]
    message = _messages(recorded, ranks)
    senders: dict[int, tuple[int, int]] = {}
    stages = []
    for stage, ops in enumerate(recorded):
        b = _StageBuilder()
        seen: dict[int, int] = defaultdict(int)  # collectives so far, per group kind
        for i, op in enumerate(ops):
            _compile_op(b, op, i, message, stage, ranks, topo, seen)
            if isinstance(op, ISend):
                senders[message[(stage, i)]] = (stage, ranks.index(op.dst))
        stages.append(b.build())
    return PipeProgram(tuple(stages), tuple(senders[m] for m in range(len(senders))))


def _compile_op(b: _StageBuilder, op: Op, index: int, message: dict[tuple[int, int], int],
                stage: int, ranks: Sequence[int], topo: Topology, seen: dict[int, int]) -> None:
    """Op number ``index`` of a stage's recorded ops, onto ``b``."""
    rank, msg = ranks[stage], message.get((stage, index))
    if isinstance(op, Compute):
        b.ops.append((COMPUTE, b.event(op.name, op), float(op.cost_s)))
    elif isinstance(op, ISend):
        ev = b.event(op.name, op, op.nbytes, peer=ranks.index(op.dst))
        b.ops.append((SEND, ev, msg, int(op.nbytes)))
        if isinstance(op, Send):
            b.ops.append((WAIT, msg))
    elif isinstance(op, IRecv):
        ev = b.event(op.name, op, op.nbytes, peer=ranks.index(op.src))
        b.ops.append((RECV_WAIT if isinstance(op, Recv) else RECV, ev, msg))
    elif isinstance(op, Wait):
        handle = op.handle
        if not isinstance(handle, _Handle):
            raise NotStatic("Wait on something that is not a send, receive or collective handle")
        if handle.op_index in b.posted:
            b.ops.append((COLLECTIVE_WAIT, *b.posted[handle.op_index]))
        else:
            b.ops.append((WAIT, message[(stage, handle.op_index)]))
    elif isinstance(op, AllReduce):
        kind = group_kind(topo, rank, op.group)
        ev = b.event(op.name, op, op.nbytes, kind=kind)
        steps = 1 if isinstance(op, (ReduceScatter, AllGather)) else 2  # ring passes
        code = ASYNC_COLLECTIVE if op.async_op else COLLECTIVE
        b.ops.append((code, ev, kind, int(op.nbytes), seen[kind], steps))
        seen[kind] += 1
        if op.async_op:
            b.posted[index] = (ev, kind)
    else:
        raise NotStatic(f"no compiled form for {type(op).__name__}")


def pipe_ranks(topo: Topology, pipe: int) -> tuple[int, ...]:
    """Global ranks of pipeline ``pipe`` (= dp·tp_size + tp) by stage."""
    return topo.pp_groups[pipe]


# ---------------------------------------------------------- recorded times
def time_order(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Each row's columns ordered by start, longest first at a tie, else by
    column: ``np.lexsort((-(end - start), start), axis=-1)``. A rank's clock
    only moves forward through its program, so its starts seldom decrease:
    there only the runs of equal starts are sorted, in one compiled pass."""
    order = np.empty(start.shape, np.int64)
    if start.shape[1] < 2 or not _order_ties(np.ascontiguousarray(start),
                                            np.ascontiguousarray(-(end - start)), order):
        return np.lexsort((-(end - start), start), axis=-1)
    return order


@njit(cache=True)
def _after(x: float, y: float) -> bool:
    """Whether key ``x`` sorts strictly after ``y`` (NaN last, as a sort puts it)."""
    if np.isnan(y):
        return False
    return bool(np.isnan(x) or x > y)


@njit(cache=True)
def _order_ties(start: np.ndarray, key: np.ndarray, order: np.ndarray) -> bool:
    """Fill ``order`` with each row's columns, each run of equal starts sorted
    by ``key`` (stable); False, and ``order`` unfinished, where a row's starts
    decrease or are NaN (a whole sort is needed there)."""
    rows, cols = start.shape
    for r in range(rows):
        for c in range(1, cols):
            if not start[r, c] >= start[r, c - 1]:
                return False
    for r in range(rows):
        j = 0
        while j < cols:
            order[r, j] = j
            k = j + 1
            while k < cols and start[r, k] == start[r, j]:
                order[r, k] = k
                k += 1
            for a in range(j + 1, k):  # a run is a few ops at one instant
                moved, b = order[r, a], a - 1
                while b >= j and _after(key[r, order[r, b]], key[r, moved]):
                    order[r, b + 1] = order[r, b]
                    b -= 1
                order[r, b + 1] = moved
            j = k
    return True


@dataclass(frozen=True)
class CompiledRun:
    """A simulated job in compact form: per class of identical pipelines, the
    times its representative recorded (per stage, one start and end per event),
    and the pipelines that class stands for. Rows are produced on demand."""

    program: PipeProgram
    topo: Topology
    classes: tuple[tuple[int, ...], ...]
    starts: tuple[tuple[np.ndarray, ...], ...]  # [class][stage]
    ends: tuple[tuple[np.ndarray, ...], ...]
    # hands back the pages of times kept in a mapped file (``sim.spill``) once
    # a batch has copied what it needs; None where they are plain arrays
    release: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    @property
    def pipes(self) -> int:
        return self.topo.dp * self.topo.tp

    @property
    def events(self) -> int:
        return self.pipes * self.program.events_per_pipe

    def class_of_pipe(self) -> np.ndarray:
        out = np.zeros(self.pipes, np.int64)
        for i, members in enumerate(self.classes):
            out[list(members)] = i
        return out

    @cached_property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Group ids: every TP group, then every DP group, every model-parallel
        group, every pipeline's embedding group."""
        t = self.topo
        return (tuple(t.tp_groups) + tuple(t.dp_groups) + tuple(t.model_parallel_groups)
                + tuple(embedding_group(g) for g in t.pp_groups))

    def _in_time_order(self, stage: int, cls: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The events of ``stage`` of each class in ``cls`` ordered as the trace
        loader orders a rank's events (by start, longest first at a tie, else
        program order), as (event index, start, end) matrices of shape
        (len(cls), events). Built for the classes asked for only: a batch of
        rows holds its own, never every class's at once."""
        once = bool((np.diff(cls) > 0).all())  # each class once, in order (nothing reduced)
        distinct, back = (cls, None) if once else np.unique(cls, return_inverse=True)
        start = np.stack([self.starts[c][stage] for c in distinct.tolist()])
        end = np.stack([self.ends[c][stage] for c in distinct.tolist()])
        if self.release is not None:  # copied out: the recorded times' pages can go
            self.release()
        order = time_order(start, end)
        start = np.take_along_axis(start, order, 1)
        end = np.take_along_axis(end, order, 1)
        if back is None:
            return order.astype(np.int32), start, end
        return order.astype(np.int32)[back], start[back], end[back]

    def rows(self, stage: int, pipes: np.ndarray, cls: np.ndarray | None = None) -> EventColumns:
        """Events of ``stage`` on each of ``pipes`` (in that order): the ranks
        ``stage·dp·tp + pipe``, each row copied from its class's representative,
        each rank's rows in time order."""
        t = self.topo
        cls = self.class_of_pipe()[pipes] if cls is None else cls
        order, start, end = self._in_time_order(stage, cls)
        has_extra = self.program.has_extra  # else no gather of a column of Nones
        static = {k: v[order] for k, v in self.program.static_fields[stage].items()
                  if has_extra or k != "extra"}
        rank = (stage * t.dp * t.tp + pipes).astype(np.int32)
        dp, tp = (pipes // t.tp)[:, None], (pipes % t.tp)[:, None]
        peer_stage, kind = static["peer_stage"], static["group_kind"]
        peer = np.where(peer_stage >= 0, tp + t.tp * (dp + t.dp * peer_stage), -1)
        tp_id = stage * t.dp + dp
        dp_id = t.pp * t.dp + stage * t.tp + tp
        mp_id = t.pp * t.dp + t.pp * t.tp + dp
        emb_id = t.pp * t.dp + t.pp * t.tp + t.dp + pipes[:, None]
        gid = np.select([kind == 0, kind == 1, kind == 2, kind == 3],
                        [tp_id, dp_id, mp_id, emb_id], -1)
        return EventColumns(
            rank=np.repeat(rank, order.shape[1]), name=static["name"].ravel(),
            kind=static["kind"].ravel(), start_s=start.ravel(), dur_s=(end - start).ravel(),
            iteration=static["iteration"].ravel(), microbatch=static["microbatch"].ravel(),
            chunk=static["chunk"].ravel(), nbytes=static["nbytes"].ravel(),
            peer=peer.astype(np.int32).ravel(), group=gid.astype(np.int32).ravel(),
            role=static["role"].ravel(), tag=static["tag"].ravel(),
            names=self.program.names, groups=self.groups,
            extra=static["extra"].ravel() if has_extra else None)

    def batches(self, max_rows: int = 1 << 20) -> Iterator[EventColumns]:
        """Every event, ranks in ascending order, at most about ``max_rows`` at
        a time: each batch the ranks of whole data-parallel replicas of one
        stage (as many as fit, one at least), so that a reader of some
        replicas (``trace.store.read_columns``) reads only their batches."""
        cls_all = self.class_of_pipe()
        tp = self.topo.tp
        for stage, st in enumerate(self.program.stages):
            step = tp * max(1, max_rows // max(st.events * tp, 1))
            for lo in range(0, self.pipes, step):
                pipes = np.arange(lo, min(lo + step, self.pipes))
                yield self.rows(stage, pipes, cls_all[pipes])

    def ranks(self) -> Sequence[int]:
        return range(self.topo.world_size)

    def rank_rows(self, rank: int) -> EventColumns:
        c = self.topo.coord(rank)
        return self.rows(c.pp, np.array([c.dp * self.topo.tp + c.tp]))

    def columns(self) -> EventColumns:
        return concat_same(list(self.batches()))

    def compact(self) -> tuple[EventColumns, np.ndarray]:
        """The representatives' events and how many ranks each row stands for."""
        return self._class_rows(np.arange(len(self.classes)))

    def weighted_batches(self, max_rows: int = 1 << 20) -> Iterator[tuple[EventColumns, np.ndarray]]:
        """``compact``'s rows a few classes at a time: whole pipelines (both
        sides of every transfer), about ``max_rows`` rows a batch."""
        step = max(1, max_rows // max(self.program.events_per_pipe, 1))
        for lo in range(0, len(self.classes), step):
            yield self._class_rows(np.arange(lo, min(lo + step, len(self.classes))))

    def _class_rows(self, cls: np.ndarray) -> tuple[EventColumns, np.ndarray]:
        """The events of the representatives of classes ``cls``, stage after
        stage, and the size of each row's class."""
        reps = np.array([self.classes[c][0] for c in cls.tolist()], np.int64)
        size = np.array([len(self.classes[c]) for c in cls.tolist()], np.int64)
        parts = [self.rows(stage, reps, cls) for stage in range(self.topo.pp)]
        weights = [np.repeat(size, st.events) for st in self.program.stages]
        return concat_same(parts), np.concatenate(weights).astype(float)

    def stand_ins(self) -> dict[int, tuple[int, ...]]:
        """Each simulated rank -> the ranks (same stage) of every pipeline of its class."""
        out = {}
        for members in self.classes:
            for stage in range(self.topo.pp):
                out[pipe_ranks(self.topo, members[0])[stage]] = tuple(
                    pipe_ranks(self.topo, p)[stage] for p in members)
        return out

