"""The reference SimPy interpreter: runs rank programs on the simulated cluster.

Each rank program runs inside one SimPy process. Sends are eager (the
transfer starts when the send is posted); a receive completes when its
message has arrived. Collectives rendezvous per (group, sequence number) and
end together, their ring cost after the last member arrives. Events are
recorded in true simulated time; the rank clocks keep the injected skew.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import simpy

from megatronapp.errors import UserError
from megatronapp.host.gc_pause import paused_gc
from megatronapp.parallel.ops import (AllGather, AllReduce, Compute, IRecv, ISend, Op, RankProgram, Recv,
                             ReduceScatter, Send, Wait, WaitAny, describe, trace_args)
from megatronapp.trace.events import Event, Tracer
from .cluster import Cluster
from .network import succeeds


class SimDeadlock(UserError):
    """Some rank programs can never finish; names each and what it waits for
    (one line and exit status 2 from the CLI)."""

    def __init__(self, blocked: dict[int, str]):
        lines = ", ".join(f"rank {r} on {what}" for r, what in sorted(blocked.items())[:8])
        super().__init__(f"deadlock: {len(blocked)} rank(s) blocked: {lines}")
        self.blocked = blocked


MailKey = tuple[int, int, Hashable]  # (src, dst, tag)


@dataclass
class Mailbox:
    """Messages that arrived before their receive was posted, and vice versa."""

    env: simpy.Environment
    arrived: dict[MailKey, list[Any]] = field(default_factory=lambda: defaultdict(list))
    waiting: dict[MailKey, list[simpy.Event]] = field(default_factory=lambda: defaultdict(list))

    def put(self, key: MailKey, value: Any) -> None:
        if self.waiting.get(key):
            self.waiting[key].pop(0).succeed(value)
        else:
            self.arrived[key].append(value)

    def get(self, key: MailKey) -> simpy.Event:
        event = self.env.event()
        if self.arrived.get(key):
            event.succeed(self.arrived[key].pop(0))
        else:
            self.waiting[key].append(event)
        return event


@dataclass
class _Rendezvous:
    event: simpy.Event
    nbytes: int
    arrived: int = 0


COLLECTIVE_KINDS = {AllReduce: "all_reduce", ReduceScatter: "reduce_scatter",
                    AllGather: "all_gather"}


class SimInterpreter:
    """One simulation of a set of rank programs on a cluster.

    ``simulated``: the ranks whose programs run (default all). A collective
    completes once its simulated members have arrived and is priced for its
    whole group: with no faults or jitter, data-parallel replicas have
    identical timelines, so one replica stands for all (``run_replica``).
    """

    def __init__(self, cluster: Cluster, on_record: Callable[[int, Event], None] | None = None,
                 simulated: frozenset[int] | None = None,
                 op_overhead_s: float = 0.0):
        self.cluster = cluster
        self.op_overhead_s = op_overhead_s  # host time to issue each op (not Wait)
        self.env = cluster.env
        self.mailbox = Mailbox(self.env)
        self.simulated = simulated
        ranks = range(cluster.topo.world_size) if simulated is None else sorted(simulated)
        self.tracers = {r: Tracer(r, now=lambda: self.env.now, on_record=on_record)
                        for r in ranks}
        self._collectives: dict[tuple[tuple[int, ...], int], _Rendezvous] = {}
        self._seq: dict[tuple[int, tuple[int, ...]], int] = defaultdict(int)
        self._busy_until: dict[tuple[int, ...], float] = {}  # one stream per communicator
        self._blocked_on: dict[int, Op | None] = {}
        self._handlers: dict[type, Callable[[int, Any], Any]] = {
            Compute: self._compute, ISend: self._isend, IRecv: self._irecv,
            Send: self._send, Recv: self._recv, Wait: self._wait, WaitAny: self._wait_any,
            AllReduce: self._allreduce, ReduceScatter: self._collective,
            AllGather: self._collective,
        }

    # ----------------------------------------------------------------- driver
    def run(self, programs: dict[int, RankProgram]) -> dict[int, list[Event]]:
        for rank, program in programs.items():
            self._blocked_on[rank] = None
            self.env.process(self._drive(rank, program))
        with paused_gc():
            self.env.run()
        if self._blocked_on:
            raise SimDeadlock({r: describe(op) for r, op in self._blocked_on.items()})
        return {r: t.events for r, t in self.tracers.items()}

    def _drive(self, rank: int, program: RankProgram):
        result: Any = None
        while True:
            try:
                op = program.send(result)
            except StopIteration:
                del self._blocked_on[rank]
                return
            self._blocked_on[rank] = op
            if self.op_overhead_s > 0 and not isinstance(op, (Wait, WaitAny)):
                yield self.env.timeout(self.op_overhead_s)
            result = yield from self._handlers[type(op)](rank, op)

    # -------------------------------------------------------------- handlers
    def _compute(self, rank: int, op: Compute):
        device = self.cluster.devices[rank]
        iteration = op.meta.get("iteration", -1)
        stall = device.host_delay_s(op.name, iteration)
        if stall > 0:  # host time before the op, outside it
            yield self.env.timeout(stall)
        start = self.env.now
        yield self.env.timeout(device.duration(start, op.cost_s, iteration))
        result = op.run() if op.run is not None else None
        self.tracers[rank].record(op.name, start, self.env.now, trace_args(op, result=result))
        return result

    def _isend(self, rank: int, op: ISend | Send):
        start = self.env.now
        key = (rank, op.dst, op.tag)
        delivered = self._transfer(rank, op.dst, op.nbytes)
        args = trace_args(op)

        def on_delivered(_e: simpy.Event) -> None:
            self.tracers[rank].record(op.name, start, self.env.now, args)
            self.mailbox.put(key, op.tensor)

        delivered.callbacks.append(on_delivered)
        return delivered
        yield  # pragma: no cover - makes this a generator

    def _transfer(self, src: int, dst: int, nbytes: int) -> simpy.Event:
        """The network move behind a send (subclasses map ranks onto devices)."""
        return self.cluster.network.transfer(src, dst, nbytes)

    def _ring_s(self, group: tuple[int, ...], nbytes: int, kind: str = "all_reduce") -> float:
        """How long a ring collective over ``group`` takes (subclasses map ranks onto devices)."""
        return self.cluster.network.ring_collective_s(kind, group, nbytes)

    def _irecv(self, rank: int, op: IRecv | Recv):
        start = self.env.now
        arrived = self.mailbox.get((op.src, rank, op.tag))
        args = trace_args(op)
        arrived.callbacks.append(
            lambda _e: self.tracers[rank].record(op.name, start, self.env.now, args))
        return arrived
        yield  # pragma: no cover

    def _send(self, rank: int, op: Send):
        handle = yield from self._isend(rank, op)
        return (yield from self._wait(rank, Wait(handle)))

    def _recv(self, rank: int, op: Recv):
        handle = yield from self._irecv(rank, op)
        return (yield from self._wait(rank, Wait(handle)))

    def _wait(self, rank: int, op: Wait):
        handle = op.handle
        if not handle.processed:
            yield handle
        return handle.value

    def _wait_any(self, rank: int, op: WaitAny):
        if not any(h.processed for h in op.handles):
            yield self.env.any_of(list(op.handles))
        return next(i for i, h in enumerate(op.handles) if h.processed or h.triggered)

    def _members(self, group: tuple[int, ...]) -> int:
        if self.simulated is None:
            return len(group)
        return sum(1 for r in group if r in self.simulated)

    def _collective(self, rank: int, op: AllReduce):
        group = op.group
        if rank not in group:
            raise ValueError(f"rank {rank} is not in collective group {group}")
        seq_key = (rank, group)
        key = (group, self._seq[seq_key])
        self._seq[seq_key] += 1
        rv = self._collectives.get(key)
        if rv is None:
            rv = self._collectives[key] = _Rendezvous(self.env.event(), op.nbytes)
        elif rv.nbytes != op.nbytes:
            raise ValueError(f"rank {rank}: {type(op).__name__} on {group} with {op.nbytes} "
                             f"bytes, others use {rv.nbytes}")
        rv.arrived += 1
        if rv.arrived == self._members(group):
            del self._collectives[key]
            self._start_collective(COLLECTIVE_KINDS[type(op)], group, op.nbytes, rv.event)
        start = self.env.now
        args = trace_args(op)
        if op.async_op:
            rv.event.callbacks.append(
                lambda _e: self.tracers[rank].record(op.name, start, self.env.now, args))
            return rv.event
        yield rv.event
        self.tracers[rank].record(op.name, start, self.env.now, args)
        return op.tensor

    _allreduce = _collective  # the name subclasses override (MegaFBD's coordinator)

    def _start_collective(self, kind: str, group: tuple[int, ...], nbytes: int,
                          done: simpy.Event) -> None:
        """Collectives on one communicator run one after another (NCCL's stream order)."""
        begin = max(self.env.now, self._busy_until.get(group, 0.0))
        end = begin + self._ring_s(group, nbytes, kind)
        self._busy_until[group] = end
        self.env.timeout(end - self.env.now).callbacks.append(succeeds(done))
