"""The compiled simulation engine: flat per-stage operation arrays, one loop.

Each simulated rank walks its stage's operations with its own clock,
dataflow style: compute advances the clock (the device prices it), a
receive or a wait moves the clock to the message's delivery, a collective
ends ``ring cost`` after its last member arrives (and after the previous
collective on its communicator), whichever order the members are visited
in; a rank that posted one asynchronously goes on and waits for its end
later. Only what shares a resource needs a time order:
point-to-point flows crossing a port. Flow starts and completions go through a
heap in time order and share ports with the same fluid arithmetic as the SimPy
engine (``sim.network.FluidPorts``, which takes a fast path for a flow alone on
its ports). A rank resumed by a delivery at time T only ever posts later
flows, so a heap never receives an event in its past. Transfers with fixed
costs, empty transfers and collectives never touch a heap.

Flows never leave their pipeline, so each block of ranks that share ports or
frequent collectives (a replica: TP x PP ranks) keeps its own heap and runs
ahead of the others as far as its horizon allows (``Engine._entries``): a
replica is simulated from end to end while its few megabytes stay in cache,
rather than every rank of the job being visited at every instant.

Times are recorded into per-rank arrays (start, end per event); the static
fields of every event come from the compiled program. With symmetry classes
only one pipeline per class runs, and collectives meet across classes
through ``PipeClasses.rendezvous``. The hot loop is written out inline on
purpose: it runs once per operation of a 12,288-GPU job.
"""
from __future__ import annotations

import heapq
import math
from array import array
from typing import Any, Callable, Iterator

import networkx as nx
import numpy as np

from megatronapp.program.compiled import (ASYNC_COLLECTIVE, COLLECTIVE, COLLECTIVE_WAIT, COMPUTE,
                                  GROUP_KINDS, RECV, RECV_WAIT, SEND, WAIT, CompiledRun,
                                  PipeProgram, kind_group, pipe_ranks)
from megatronapp.errors import Recreatable
from megatronapp.host.gc_pause import paused_gc
from sim.cluster import Cluster
from sim.network import Flow
from sim.symmetry import PipeClasses

PLAIN, NOISY, DEVICE = range(3)  # how a rank prices compute
PROGRESS_EVERY = 1 << 16  # operations between progress reports


def blocks_of(stage: list[int], coll_key: list[list[int]]) -> list[int]:
    """Block of each simulated rank: the ranks of a pipeline share ports (stage 0
    starts one), and the members of a collective other than a data-parallel one
    meet at every layer, so they share a block too: one block per replica
    (TP x PP ranks) when nothing is reduced."""
    graph = nx.Graph()
    graph.add_nodes_from(range(len(stage)))
    members: dict[int, list[int]] = {}
    for i, keys in enumerate(coll_key):
        if stage[i]:
            graph.add_edge(i - 1, i)
        for kind, key in enumerate(keys):
            if GROUP_KINDS[kind] != "dp":
                members.setdefault(key, []).append(i)
    for ranks in members.values():
        nx.add_path(graph, ranks)
    block = [0] * len(stage)
    for b, component in enumerate(sorted(nx.connected_components(graph), key=min)):
        for i in component:
            block[i] = b
    return block


def message_tables(program: PipeProgram) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per message of the pipeline: its send's event, its receive's event, its
    sender's stage and its receiver's stage."""
    send_ev, recv_ev = [0] * len(program.messages), [0] * len(program.messages)
    for st in program.stages:
        for op in st.ops:
            if op[0] == SEND:
                send_ev[op[2]] = op[1]
            elif op[0] in (RECV, RECV_WAIT):
                recv_ev[op[2]] = op[1]
    return (send_ev, recv_ev, [s for s, _d in program.messages],
            [d for _s, d in program.messages])


class CompiledDeadlock(Recreatable, Exception):
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
        self._blocks()
        self.ready: list[int] = []
        # per block: a heap of the instants something is due, and for each instant
        # its flow starts (version -1) and completions: flow, version, flow, version...
        self.times: list[list[float]] = [[] for _ in range(self.n_blocks)]
        self.due: list[dict[float, list[Any]]] = [{} for _ in range(self.n_blocks)]
        self.total_ops = sum(len(o) for o in self.ops)

    # ------------------------------------------------------------- set-up
    def _messages(self, program: PipeProgram, p_count: int) -> None:
        m_count = len(program.messages)
        self.send_ev, self.recv_ev, self.msg_src, self.msg_dst = message_tables(program)
        n = len(self.ranks)
        self.slot_base = [(i // p_count) * m_count for i in range(n)]
        self.arrive = [-1.0] * (m_count * (n // p_count))  # delivery time, -1 = not yet
        self.posted = bytearray(len(self.arrive))  # receive posted before delivery
        self.waiting: dict[int, list[int]] = {}  # message slot -> ranks blocked on it

    def _devices(self, cluster: Cluster) -> None:
        self.device = [cluster.devices[r] for r in self.ranks]
        self.pricing = [DEVICE if d.faulty else (NOISY if d.is_noisy else PLAIN)
                        for d in self.device]
        stages = self.program.stages  # a faulty device's ops: their name and iteration
        self.op_names = [stages[s].names for s in self.stage]
        self.op_iterations = [stages[s].iteration for s in self.stage]

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
        # groups of a kind partition the ranks: (kind, first member) names one; its
        # rendezvous and ring are found once, not once per member (a 12k-rank dp group)
        met: dict[tuple[int, int], tuple[Any, int, Any]] = {}
        for rank in self.ranks:
            row_keys, row_rings = [], []
            for kind in range(len(GROUP_KINDS)):
                group = kind_group(topo, kind, rank)
                found = met.get((kind, group[0]))
                if found is None:
                    found = met[(kind, group[0])] = (*classes.rendezvous(rank, kind, rep_of),
                                                     net.ring(group))
                key, need, ring = found
                if key not in keys:
                    keys[key] = len(keys)
                    self.need.append(need)
                row_keys.append(keys[key])
                row_rings.append(ring)
            self.coll_key.append(row_keys)
            self.ring.append(row_rings)
        self.n_keys = len(keys)
        # n-th * n_keys + rendezvous -> [members still to come, latest arrival,
        # then each rank that arrived (~rank if it went on) and its event]
        self.rendezvous: dict[int, list[Any]] = {}
        self.busy = [0.0] * self.n_keys  # when each communicator's last collective ends
        self.in_flight: dict[tuple[int, int], list[Any]] = {}  # (rank, posted event) -> rendezvous
        self.collective_wait: dict[int, int] = {}  # rank -> the posted collective it waits for

    def _blocks(self) -> None:
        """Split the simulated ranks into blocks that keep their own time order
        (``blocks_of``); a collective spanning blocks is where they meet."""
        self.block = blocks_of(self.stage, self.coll_key)
        self.n_blocks = max(self.block) + 1
        spans: list[set[int]] = [set() for _ in range(self.n_keys)]
        for i, keys in enumerate(self.coll_key):
            for key in keys:
                spans[key].add(self.block[i])
        self.cross = [len(b) > 1 for b in spans]
        # per block: its ranks waiting at a collective that spans blocks -> its rendezvous;
        # no later than the earliest latest-arrival among those rendezvous (see _entries),
        # lowered as ranks come to wait, raised when ``floor_stale`` after they resume
        self.cross_wait: list[dict[int, list[Any]]] = [{} for _ in range(self.n_blocks)]
        self.floor = [math.inf] * self.n_blocks
        self.floor_stale = [False] * self.n_blocks

    # ---------------------------------------------------------------- run
    def post(self, block: int, when: float, flow: Flow, version: int) -> None:
        """Schedule a flow's start (version -1) or completion at ``when``."""
        pending = self.due[block]
        due = pending.get(when)
        if due is None:
            pending[when] = [flow, version]
            heapq.heappush(self.times[block], when)
        else:  # same instant: after what was posted for it before
            due.append(flow)
            due.append(version)

    def run(self) -> None:
        with paused_gc():  # its scans of every live object of a 12k-GPU job find no garbage
            self._run()
        blocked = {self.ranks[i]: self._describe(i) for i in range(len(self.ranks))
                   if self.pc[i] < len(self.ops[i])}
        if blocked:
            raise CompiledDeadlock(blocked)

    def _entries(self) -> Iterator[tuple[int, float, Flow, int]]:
        """Every due flow start or completion as (block, instant, flow, version), in
        each block's time order (one instant: post order), a block at a time.

        A block may run ahead of the others up to its horizon: nothing can be posted
        into it earlier, since only its own ranks post into it, and those waiting at
        a collective spanning blocks resume no earlier than the latest arrival there
        nor than ``low``, the earliest instant due anywhere (whatever resumes them
        follows from something due at ``low`` or later). The block holding ``low``
        can always go on, so every sweep over the blocks makes progress."""
        heaps, dues, pop = self.times, self.due, heapq.heappop
        floor, stale = self.floor, self.floor_stale
        while True:
            low = min((h[0] for h in heaps if h), default=None)
            if low is None:
                return
            for b, heap in enumerate(heaps):
                if not heap:
                    continue
                if stale[b]:
                    floor[b] = min((rv[1] for rv in self.cross_wait[b].values()),
                                   default=math.inf)
                    stale[b] = False
                pending = dues[b]
                while heap:
                    now = heap[0]
                    if now > low and now >= floor[b]:  # past its horizon, max(floor, low)
                        break
                    pop(heap)
                    due = pending[now]
                    k = 0
                    while k < len(due):  # grows while it runs: flows posted for this instant
                        yield b, now, due[k], due[k + 1]
                        k += 2
                    del pending[now]

    def _run(self) -> None:
        """Advance every ready rank until it blocks, then take the next due flow
        start or completion (``_entries``), until none is due. A rank's advance is
        written out here rather than called: it runs at every resumption, about
        every third operation."""
        send, complete, flow_event = self._send, self._complete, self._flow_event
        asynchronous = self._asynchronous
        ready, ops_of, pcs, clocks = self.ready, self.ops, self.pc, self.t
        starts, ends, slot_bases, pricings = self.starts, self.ends, self.slot_base, self.pricing
        coll_keys, rendezvous, need, n_keys = self.coll_key, self.rendezvous, self.need, self.n_keys
        cross, cross_wait, blocks, floor = self.cross, self.cross_wait, self.block, self.floor
        arrive, posted, waiting = self.arrive, self.posted, self.waiting
        overhead = self.op_overhead_s
        progress, total = self.progress, self.total_ops
        entries = self._entries()
        ready.extend(range(len(self.ranks) - 1, -1, -1))  # rank 0 first
        executed = 0
        while True:
            while ready:
                i = ready.pop()
                ops, pc, t = ops_of[i], pcs[i], clocks[i]
                st, en, sbase, pricing, coll_key = (starts[i], ends[i], slot_bases[i],
                                                    pricings[i], coll_keys[i])
                start_pc, n = pc, len(ops)
                while pc < n:
                    op = ops[pc]
                    code = op[0]
                    if overhead and code != WAIT and code != COLLECTIVE_WAIT:
                        t = t + overhead
                    if code == COMPUTE:
                        if pricing == DEVICE:  # host time its faults put before it
                            t = t + self.device[i].host_delay_s(self.op_names[i][op[1]],
                                                                self.op_iterations[i][op[1]])
                        st[op[1]] = t
                        if pricing == PLAIN:
                            t = t + op[2]
                        elif pricing == NOISY:
                            t = t + self.device[i].noisy(op[2])
                        else:
                            t = t + self.device[i].duration(t, op[2],
                                                            self.op_iterations[i][op[1]])
                        en[op[1]] = t
                    elif code == COLLECTIVE:
                        st[op[1]] = t
                        ck = coll_key[op[2]]
                        key = op[4] * n_keys + ck  # (rendezvous, n-th of its kind) as one int
                        rv = rendezvous.get(key)
                        if rv is not None and rv[0] > 1:  # not the last to arrive: wait
                            rv[0] -= 1
                            if t > rv[1]:
                                rv[1] = t
                            rv.append(i)
                            rv.append(op[1])
                        elif rv is None and need[ck] > 1:  # the first to arrive
                            rv = rendezvous[key] = [need[ck] - 1, t, i, op[1]]
                        else:
                            t = en[op[1]] = complete(i, op, t, rv, key)
                            pc += 1
                            continue
                        if cross[ck]:  # it resumes no earlier than the latest arrival
                            cross_wait[blocks[i]][i] = rv
                            if rv[1] < floor[blocks[i]]:
                                floor[blocks[i]] = rv[1]
                        break
                    elif code == RECV_WAIT or code == RECV:
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
                            posted[slot] = 1
                            if code == RECV_WAIT:
                                waiting.setdefault(slot, []).append(i)
                                break
                    elif code == SEND:
                        st[op[1]] = t
                        send(i, op[2], op[3], t, sbase + op[2])
                    elif code == WAIT:
                        slot = sbase + op[1]
                        a = arrive[slot]
                        if a < 0.0:
                            waiting.setdefault(slot, []).append(i)
                            break
                        if a > t:
                            t = a
                    else:  # an asynchronous collective posted, or waited for
                        after = asynchronous(i, op, t)
                        if after < 0.0:
                            break
                        t = after
                    pc += 1
                pcs[i] = pc
                clocks[i] = t if pc < n else math.inf
                executed += pc - start_pc
            if progress is not None and executed >= PROGRESS_EVERY:
                progress(executed, total)
                executed = 0
            entry = next(entries, None)
            if entry is None:
                return
            flow_event(*entry)

    def _flow_event(self, block: int, now: float, flow: Flow, version: int) -> None:
        """A flow of ``block`` starts (``version`` -1) or completes at ``now``."""
        a, b = flow.ports
        if version < 0:
            if a.flows or b.flows:
                for f, eta in self.fluid.start(flow, now):
                    self.post(block, now + eta, f, f.version)
            else:
                self.post(block, now + self.fluid.start_alone(flow, now), flow, flow.version)
        elif version == flow.version:  # else stale: the flow's rate changed since
            if len(a.flows) == 1 and len(b.flows) == 1:  # alone: nothing to reschedule
                a.flows.clear()
                b.flows.clear()
            else:
                for f, eta in self.fluid.finish(flow, version, now) or ():
                    self.post(block, now + eta, f, f.version)
            self.deliver(flow.tag, now + flow.tag[3])

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

    def _send(self, i: int, m: int, nbytes: int, t: float, slot: int) -> None:
        link = self.link_row[i][self.msg_dst[m]]
        slow = link.slowdown(t)
        note = (slot, i, m, self.latency_row[i][self.msg_dst[m]])
        wait = link.delay_s(t, nbytes, slow) if link.outages else 0.0  # a flapping link
        if self.fixed_p2p is not None:  # summed as the interpreter's one timeout sums them
            self.deliver(note, t + (self.fixed_p2p * slow + wait))
            return
        t = t + wait  # the transfer starts once the link is back
        if nbytes <= 0:
            self.deliver(note, t + note[3])
        else:  # starts in time order: it may share a port with flows not started yet
            self.post(self.block[i], t, Flow(nbytes * slow, link.ports, None, note), -1)

    def _asynchronous(self, i: int, op: tuple[Any, ...], t: float) -> float:
        """Rank ``i`` at ``t`` posts a collective it does not wait for (the
        same ``t`` back: it goes on), or waits for one it posted: when it may
        go on, or -1 while the collective has not ended."""
        ev = op[1]
        if op[0] == COLLECTIVE_WAIT:
            rv = self.in_flight.get((i, ev))
            if rv is None:  # ended
                end: float = self.ends[i][ev]
                return end if end > t else t
            self.collective_wait[i] = ev
            if self.cross[self.coll_key[i][op[2]]]:  # it resumes no earlier than the latest arrival
                block = self.block[i]
                self.cross_wait[block][i] = rv
                if rv[1] < self.floor[block]:
                    self.floor[block] = rv[1]
            return -1.0
        self.starts[i][ev] = t
        ck = self.coll_key[i][op[2]]
        key = op[4] * self.n_keys + ck
        rv = self.rendezvous.get(key)
        if rv is not None and rv[0] > 1:
            rv[0] -= 1
            if t > rv[1]:
                rv[1] = t
            rv += (~i, ev)
        elif rv is None and self.need[ck] > 1:
            rv = self.rendezvous[key] = [self.need[ck] - 1, t, ~i, ev]
        else:
            self.ends[i][ev] = self._complete(i, op, t, rv, key)
            return t
        self.in_flight[(i, ev)] = rv
        return t

    def _complete(self, i: int, op: tuple[Any, ...], t: float, rv: list[Any] | None,
                  key: int) -> float:
        """Rank ``i`` is the last to arrive (at ``t``) at a collective: its end
        time, with every rank that waited for it resumed (and every rank that
        posted it and went on given its end)."""
        _code, _ev, kind, nbytes, _nth, steps = op
        ck = key % self.n_keys
        if rv is None:  # a group of one representative
            return self._ring_end(self.ring[i][kind].seconds(nbytes, steps, t), t, ck)
        del self.rendezvous[key]
        latest = rv[1] if rv[1] > t else t
        done = self._ring_end(self.ring[i][kind].seconds(nbytes, steps, latest), latest, ck)
        times, pcs, ready, ends = self.t, self.pc, self.ready, self.ends
        cross = self.cross[ck]
        for k in range(2, len(rv), 2):  # the ranks that arrived before, and their events
            j, ev = rv[k], rv[k + 1]
            if j < 0:  # posted it and went on: resumed only if now waiting for it
                j = ~j
                ends[j][ev] = done
                del self.in_flight[(j, ev)]
                if self.collective_wait.get(j) != ev:
                    continue
                del self.collective_wait[j]
                if done > times[j]:
                    times[j] = done
            else:
                ends[j][ev] = done
                times[j] = done
            if cross:
                block = self.block[j]
                del self.cross_wait[block][j]
                self.floor_stale[block] = True
            pcs[j] += 1
            ready.append(j)
        return done

    def _ring_end(self, ring_s: float, latest: float, ck: int) -> float:
        """A collective's end: its ring cost after its last member arrives, or
        after the communicator's previous collective ends if that is later. The
        end is taken as the SimPy path's timeout from the last arrival lands."""
        busy = self.busy[ck]
        end = (busy if busy > latest else latest) + ring_s
        self.busy[ck] = end
        return latest + (end - latest)

    def _describe(self, i: int) -> str:
        op = self.ops[i][self.pc[i]]
        if op[0] == COLLECTIVE or op[0] == COLLECTIVE_WAIT:
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
