"""The compiled simulation engine: flat per-stage operation arrays, one loop.

Each simulated rank walks its stage's operations with its own clock,
dataflow style: compute advances the clock (the device prices it), a
receive or a wait moves the clock to the message's delivery, a collective
ends ``ring cost`` after its last member arrives, whichever order the
members are visited in. Only what shares a resource needs one global time
order: point-to-point flows crossing a port. Flow starts and completions go
through one heap in time order and share ports with the same fluid
arithmetic as the SimPy engine (``sim.network.FluidPorts``, which takes a
fast path for a flow alone on its ports). A rank resumed by a delivery at
time T only ever posts later flows, so the heap never receives an event in
its past. Transfers with fixed costs, empty transfers and collectives never
touch the heap.

Times are recorded into per-rank arrays (start, end per event); the static
fields of every event come from the compiled program. With symmetry classes
only one pipeline per class runs, and collectives meet across classes
through ``PipeClasses.rendezvous``. The hot loop is written out inline on
purpose: it runs once per operation of a 12,288-GPU job.
"""
from __future__ import annotations

import heapq
import itertools
import math
from array import array
from typing import Any, Callable

import numpy as np

from megatronapp.compiled import (COLLECTIVE, COMPUTE, GROUP_KINDS, RECV, RECV_WAIT, SEND, WAIT,
                                  CompiledRun, PipeProgram, kind_group, pipe_ranks)
from sim.cluster import Cluster
from sim.network import Flow
from sim.symmetry import PipeClasses

PLAIN, NOISY, DEVICE = range(3)  # how a rank prices compute
PROGRESS_EVERY = 1 << 16  # operations between progress reports


class CompiledDeadlock(Exception):
    def __init__(self, blocked: dict[int, str]):
        super().__init__(f"{len(blocked)} rank(s) blocked")
        self.blocked = blocked


class Engine:
    """One run of a compiled pipeline program over the representatives of ``classes``."""

    def __init__(self, cluster: Cluster, program: PipeProgram, classes: PipeClasses,
                 progress: Callable[[int, int], None] | None = None, op_overhead_s: float = 0.0):
        topo = cluster.topo
        self.op_overhead_s = op_overhead_s  # host time to issue each operation but a wait
        self.cluster, self.program, self.classes = cluster, program, classes
        self.progress = progress
        reps = classes.representatives
        self.ranks = [pipe_ranks(topo, rep)[s] for rep in reps for s in range(topo.pp)]
        self.stage = [s for _ in reps for s in range(topo.pp)]
        stages = program.stages
        self.ops = [stages[s].ops for s in self.stage]
        n = len(self.ranks)
        self.pc = [0] * n
        self.t = [0.0] * n
        self.starts = [array("d", bytes(8 * stages[s].events)) for s in self.stage]
        self.ends = [array("d", bytes(8 * stages[s].events)) for s in self.stage]
        self._messages(program, topo.pp)
        self._devices(cluster)
        self._links(cluster, topo.pp)
        self._collectives(cluster, classes)
        self.ready: list[int] = []
        self.heap: list[tuple[Any, ...]] = []
        self.seq = itertools.count()
        self.executed = 0
        self.total_ops = sum(len(o) for o in self.ops)

    # ------------------------------------------------------------- set-up
    def _messages(self, program: PipeProgram, p_count: int) -> None:
        m_count = len(program.messages)
        self.send_ev = [0] * m_count
        self.recv_ev = [0] * m_count
        for st in program.stages:
            for op in st.ops:
                if op[0] == SEND:
                    self.send_ev[op[2]] = op[1]
                elif op[0] in (RECV, RECV_WAIT):
                    self.recv_ev[op[2]] = op[1]
        self.msg_src = [s for s, _d in program.messages]
        self.msg_dst = [d for _s, d in program.messages]
        n = len(self.ranks)
        self.slot_base = [(i // p_count) * m_count for i in range(n)]
        self.arrive = [-1.0] * (m_count * (n // p_count))  # delivery time, -1 = not yet
        self.posted = bytearray(len(self.arrive))  # receive posted before delivery
        self.waiting: dict[int, list[int]] = {}  # message slot -> ranks blocked on it

    def _devices(self, cluster: Cluster) -> None:
        self.device = [cluster.devices[r] for r in self.ranks]
        self.pricing = [DEVICE if d.windows else (NOISY if d.is_noisy else PLAIN)
                        for d in self.device]

    def _links(self, cluster: Cluster, p_count: int) -> None:
        """Per simulated rank, the link to each stage of its pipeline (itself too:
        with one stage, interleaved chunks pass activations to their own rank)."""
        net = cluster.network
        self.link_row = [[net.link(self.ranks[i], self.ranks[i - self.stage[i] + d])
                          for d in range(p_count)] for i in range(len(self.ranks))]
        self.latency_row = [[net.latency(self.ranks[i], self.ranks[i - self.stage[i] + d])
                             for d in range(p_count)] for i in range(len(self.ranks))]
        self.fixed_p2p = net.fixed_p2p_s
        self.fluid = net.fluid

    def _collectives(self, cluster: Cluster, classes: PipeClasses) -> None:
        topo, net = cluster.topo, cluster.network
        rep_of = classes.representative_rank() if classes.reduced else list(range(topo.world_size))
        keys: dict[Any, int] = {}
        self.need: list[int] = []
        self.coll_key: list[list[int]] = []
        self.ring: list[list[Any]] = []
        for rank in self.ranks:
            row_keys, row_rings = [], []
            for kind in range(len(GROUP_KINDS)):
                key, need = classes.rendezvous(rank, kind, rep_of)
                if key not in keys:
                    keys[key] = len(keys)
                    self.need.append(need)
                row_keys.append(keys[key])
                row_rings.append(net.ring(kind_group(topo, kind, rank)))
            self.coll_key.append(row_keys)
            self.ring.append(row_rings)
        # (rendezvous, n-th) -> [members still to come, latest arrival, waiting (rank, event)]
        self.rendezvous: dict[tuple[int, int], list[Any]] = {}

    # ---------------------------------------------------------------- run
    def run(self) -> None:
        for i in range(len(self.ranks)):
            self.advance(i)
        self.drain()
        heap, pop, push, seq = self.heap, heapq.heappop, heapq.heappush, self.seq
        fluid, deliver = self.fluid, self.deliver
        while heap:
            now, _, flow, version = pop(heap)
            a, b = flow.ports
            if version < 0:  # a posted flow starts now
                if a.flows or b.flows:
                    for f, eta in fluid.start(flow, now):
                        push(heap, (now + eta, next(seq), f, f.version))
                else:
                    eta = fluid.start_alone(flow, now)
                    push(heap, (now + eta, next(seq), flow, flow.version))
                continue
            if version != flow.version:
                continue  # stale: the flow's rate changed since
            if len(a.flows) == 1 and len(b.flows) == 1:  # it was alone: nothing to reschedule
                a.flows.clear()
                b.flows.clear()
            else:
                for f, eta in fluid.finish(flow, version, now) or ():
                    push(heap, (now + eta, next(seq), f, f.version))
            deliver(flow.tag, now + flow.tag[3])
            self.drain()
        blocked = {self.ranks[i]: self._describe(i) for i in range(len(self.ranks))
                   if self.pc[i] < len(self.ops[i])}
        if blocked:
            raise CompiledDeadlock(blocked)

    def drain(self) -> None:
        ready, advance = self.ready, self.advance
        while ready:
            advance(ready.pop())
        if self.progress is not None and self.executed >= PROGRESS_EVERY:
            self.progress(self.executed, self.total_ops)
            self.executed = 0

    def deliver(self, note: tuple[int, int, int, float], when: float) -> None:
        """Message ``m`` (slot ``slot``) of rank ``sender`` has arrived at ``when``
        (``note``'s last field: the link's latency, added by the caller)."""
        slot, sender, m, _latency = note
        self.arrive[slot] = when
        self.ends[sender][self.send_ev[m]] = when
        if self.posted[slot]:
            receiver = sender - self.msg_src[m] + self.msg_dst[m]
            ev = self.recv_ev[m]
            posted_at = self.starts[receiver][ev]
            self.ends[receiver][ev] = when if when > posted_at else posted_at
        waiting = self.waiting.pop(slot, None)
        if waiting is not None:
            t, pc, ready = self.t, self.pc, self.ready
            for j in waiting:  # resume past the receive or wait
                if when > t[j]:
                    t[j] = when
                pc[j] += 1
                ready.append(j)

    def advance(self, i: int) -> None:
        """Run rank ``i`` until it blocks or ends."""
        ops, pc, t = self.ops[i], self.pc[i], self.t[i]
        st, en, sbase = self.starts[i], self.ends[i], self.slot_base[i]
        arrive, pricing, overhead = self.arrive, self.pricing[i], self.op_overhead_s
        start_pc, n = pc, len(ops)
        while pc < n:
            op = ops[pc]
            code = op[0]
            if overhead and code != WAIT:
                t = t + overhead
            if code == RECV_WAIT or code == RECV:
                ev = op[1]
                st[ev] = t
                slot = sbase + op[2]
                a = arrive[slot]
                if a >= 0.0:  # delivered already (or at a known later time)
                    if a > t:
                        if code == RECV_WAIT:
                            t = a
                        en[ev] = a
                    else:
                        en[ev] = t
                else:
                    self.posted[slot] = 1
                    if code == RECV_WAIT:
                        self.waiting.setdefault(slot, []).append(i)
                        break
            elif code == COMPUTE:
                st[op[1]] = t
                if pricing == PLAIN:
                    t = t + op[2]
                elif pricing == NOISY:
                    t = t + self.device[i].noisy(op[2])
                else:
                    t = t + self.device[i].duration(t, op[2])
                en[op[1]] = t
            elif code == COLLECTIVE:
                st[op[1]] = t
                done = self._arrive(i, op, t)
                if done is None:
                    break
                en[op[1]] = t = done
            elif code == SEND:
                st[op[1]] = t
                self._send(i, op[2], op[3], t, sbase + op[2])
            else:  # WAIT
                slot = sbase + op[1]
                a = arrive[slot]
                if a < 0.0:
                    self.waiting.setdefault(slot, []).append(i)
                    break
                if a > t:
                    t = a
            pc += 1
        self.pc[i] = pc
        self.t[i] = t if pc < n else math.inf
        self.executed += pc - start_pc

    def _send(self, i: int, m: int, nbytes: int, t: float, slot: int) -> None:
        link = self.link_row[i][self.msg_dst[m]]
        slow = link.slowdown()
        note = (slot, i, m, self.latency_row[i][self.msg_dst[m]])
        if self.fixed_p2p is not None:
            self.deliver(note, t + self.fixed_p2p * slow)
        elif nbytes <= 0:
            self.deliver(note, t + note[3])
        else:  # starts in time order: it may share a port with flows not started yet
            flow = Flow(nbytes * slow, link.ports, None, note)
            heapq.heappush(self.heap, (t, next(self.seq), flow, -1))

    def _arrive(self, i: int, op: tuple[Any, ...], t: float) -> float | None:
        """Arrive at a collective: its end time if this rank is the last, else None."""
        _code, ev, kind, nbytes, nth, steps = op
        ck = self.coll_key[i][kind]
        key = (ck, nth)
        rv = self.rendezvous.get(key)
        if rv is None:
            if self.need[ck] > 1:
                self.rendezvous[key] = [self.need[ck] - 1, t, [(i, ev)]]
                return None
            return t + self.ring[i][kind].seconds(nbytes, steps)
        rv[0] -= 1
        if t > rv[1]:
            rv[1] = t
        if rv[0]:
            rv[2].append((i, ev))
            return None
        del self.rendezvous[key]
        done: float = rv[1] + self.ring[i][kind].seconds(nbytes, steps)
        times, pcs, ready, ends = self.t, self.pc, self.ready, self.ends
        for j, ev_j in rv[2]:
            ends[j][ev_j] = done
            times[j] = done
            pcs[j] += 1
            ready.append(j)
        return done

    def _describe(self, i: int) -> str:
        op = self.ops[i][self.pc[i]]
        if op[0] == COLLECTIVE:
            return f"collective({GROUP_KINDS[op[2]]} group)"
        m = op[1] if len(op) == 2 else op[2]
        base = i - self.stage[i]
        src, dst = self.ranks[base + self.msg_src[m]], self.ranks[base + self.msg_dst[m]]
        return f"Recv(src={src})" if dst == self.ranks[i] else f"Wait(send to {dst})"

    # ------------------------------------------------------------- result
    def result(self) -> CompiledRun:
        p_count = self.cluster.topo.pp
        classes = range(len(self.classes.classes))
        starts = tuple(tuple(np.frombuffer(self.starts[c * p_count + s], np.float64)
                             for s in range(p_count)) for c in classes)
        ends = tuple(tuple(np.frombuffer(self.ends[c * p_count + s], np.float64)
                           for s in range(p_count)) for c in classes)
        return CompiledRun(self.program, self.cluster.topo, self.classes.classes, starts, ends)


def run_compiled(cluster: Cluster, program: PipeProgram, classes: PipeClasses,
                 progress: Callable[[int, int], None] | None = None,
                 op_overhead_s: float = 0.0) -> CompiledRun:
    engine = Engine(cluster, program, classes, progress, op_overhead_s)
    engine.run()
    return engine.result()
