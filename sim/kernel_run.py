"""A compiled pipeline program run on the compiled event loop (``sim.kernel``).

Here the program, the network and the collectives become the kernel's arrays,
and what is random is priced in bulk before the loop, through the models
themselves: each device's compute durations (``Device.durations``, in its
program order), each link direction's slowdowns (``Link.slowdowns``), each
ring's slowest-edge multipliers (``Ring.worsts``), with the very draws the
reference engine (``sim.engine``) takes one at a time. A device whose
durations depend on when work starts (throttle windows) is asked while the
loop runs, a batch of parked ranks at a time. What depends on an op's
iteration (host stalls, windows of every k-th iteration), slow-link windows
with an onset or an end (a link or a ring whose cost depends on the start
time), link flaps and crashes are not priced here (``kernel_prices``,
``NotKernel``): the reference engine runs them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, cast

import numpy as np

from megatronapp.program.compiled import (ASYNC_COLLECTIVE, COLLECTIVE, COLLECTIVE_WAIT, COMPUTE,
                                          GROUP_KINDS, RECV, RECV_WAIT, SEND, WAIT, CompiledRun,
                                          PipeProgram, kind_group, pipe_ranks)
from sim.cluster import Cluster
from sim.engine import CompiledDeadlock, message_tables
from sim.network import Ring
from sim.symmetry import PipeClasses

from . import kernel as K
from .spill import Spilled, spilled_zeros

PROGRESS_EVERY = 1 << 20  # operations between progress reports
# Times (a start and an end, 16 B an event) beyond this many bytes are kept in
# a mapped file (``sim.spill``), their pages handed back between progress
# reports and after each batch of rows is copied out of them
SPILL_BYTES = 128 << 20
RELEASE_RANKS = 1024  # ranks priced between releases


class NotKernel(Exception):
    """A job the kernel does not price (``kernel_prices``)."""


def kernel_prices(cluster: Cluster) -> bool:
    """Whether the loop prices ``cluster``'s job. It knows no iterations, no
    host time, no link drops and no job stop, and prices links before it runs:
    not where a rank's compute or host depends on the iteration (a window of
    every k-th iteration, a host stall), a slow link has an onset or an end (a
    transfer's or a ring's cost would depend on its start), a link flaps, or a
    rank crashes. The reference engine runs those."""
    effects = cluster.effects
    if effects.timed_links or effects.flapping_links or effects.stop is not None:
        return False
    return not any(device.iterated for device in cluster.devices.values())


# each operation's fields (event, x, nbytes, nth, steps, cost): where they sit
# in its tuple (``StageProgram.ops``), by code; -1 for none
_FIELDS = {COMPUTE: (1, -1, -1, -1, -1, 2), SEND: (1, 2, 3, -1, -1, -1),
           RECV: (1, 2, -1, -1, -1, -1), RECV_WAIT: (1, 2, -1, -1, -1, -1),
           WAIT: (-1, 1, -1, -1, -1, -1), COLLECTIVE: (1, 2, 3, 4, 5, -1),
           ASYNC_COLLECTIVE: (1, 2, 3, 4, 5, -1), COLLECTIVE_WAIT: (1, 2, -1, -1, -1, -1)}
_NAMES = ("ev", "x", "nbytes", "nth", "steps", "cost")


def _op_arrays(program: PipeProgram) -> dict[str, np.ndarray]:
    """Every stage's operations as flat columns, stage after stage (``lo``/``hi``:
    each stage's range)."""
    ops = [op for st in program.stages for op in st.ops]
    codes = np.array([op[0] for op in ops], np.int64)
    table = np.zeros((len(ops), len(_NAMES)))  # values as floats: exact below 2**53
    for code, fields in _FIELDS.items():
        rows = np.flatnonzero(codes == code)
        if not len(rows):
            continue
        block = np.array([ops[r][:max(fields) + 1] for r in rows.tolist()], np.float64)
        for j, at in enumerate(fields):
            if at >= 0:
                table[rows, j] = block[:, at]
    out: dict[str, np.ndarray] = {"code": codes}
    out.update({name: table[:, j] if name == "cost" else table[:, j].astype(np.int64)
                for j, name in enumerate(_NAMES)})
    sizes = np.array([len(st.ops) for st in program.stages], np.int64)
    out["hi"] = np.cumsum(sizes)
    out["lo"] = out["hi"] - sizes
    return out


@dataclass(frozen=True)
class Awaited:
    """A rendezvous whose every member simulated here has arrived, awaiting
    those simulated elsewhere: its job-wide key, which one on that
    communicator, and its latest arrival here."""

    key: Any
    nth: int
    latest: float


class KernelRun:
    """One run of a compiled pipeline program over the representatives of ``classes``."""

    def __init__(self, cluster: Cluster, program: PipeProgram, classes: PipeClasses,
                 progress: Callable[[int, int], None] | None = None, op_overhead_s: float = 0.0,
                 spill_bytes: int = SPILL_BYTES):
        topo = cluster.topo
        self.cluster, self.program, self.classes, self.progress = cluster, program, classes, progress
        pp = topo.pp
        reps = classes.representatives
        self.ranks = [pipe_ranks(topo, rep)[s] for rep in reps for s in range(pp)]
        n = len(self.ranks)
        self.ops = _op_arrays(program)
        self.stage_of = np.tile(np.arange(pp, dtype=np.int64), len(reps))
        per_stage = np.array([st.events for st in program.stages], np.int64)
        self.ev_base = np.concatenate(([0], np.cumsum(per_stage[self.stage_of])[:-1])).astype(np.int64)
        events = int(per_stage.sum()) * len(reps)
        self.spill: Spilled | None = spilled_zeros(2 * events) if 16 * events > spill_bytes else None
        times = self.spill.values if self.spill is not None else np.zeros(2 * events)
        # an event's start and end side by side: one page holds both (``sim.spill``)
        self.starts, self.ends = times[0::2], times[1::2]
        m_count = len(program.messages)
        self.send_ev, self.recv_ev, self.msg_src, self.msg_dst = (
            np.asarray(column, np.int64) for column in message_tables(program))
        self.slot_base = (np.arange(n, dtype=np.int64) // pp) * m_count
        self.overhead = float(op_overhead_s)
        self._price_computes()
        net = self._network()
        coll = self._collectives()
        self.prog = (self.ops["code"], self.ops["ev"], self.ops["x"], self.ops["nbytes"],
                     self.ops["nth"], self.ops["steps"], self.ops["cost"], self.ops["lo"],
                     self.ops["hi"], self.ev_base, self.slot_base, self.send_ev, self.recv_ev,
                     self.msg_src, self.msg_dst, self.stage_of, pp, self.overhead,
                     PROGRESS_EVERY)
        self.net, self.coll = net, coll
        self.state = self._state(n, m_count * len(reps), len(self.port_bw), len(self.busy))
        self._release()  # the durations and slowdowns priced into ``ends``

    def _release(self) -> None:
        if self.spill is not None:
            self.spill.release()

    # ------------------------------------------------------------- set-up
    def _price_computes(self) -> None:
        """Every compute's duration in its event's ``ends`` slot (NaN: priced
        while running, the device's durations depend on the start)."""
        ops = self.ops
        events, work = [], []
        for lo, hi in zip(ops["lo"], ops["hi"]):
            compute = np.flatnonzero(ops["code"][lo:hi] == COMPUTE) + lo
            events.append(ops["ev"][compute])
            work.append(ops["cost"][compute])
        for i, rank in enumerate(self.ranks):
            s = self.stage_of[i]
            device = self.cluster.devices[rank]
            slots = self.ev_base[i] + events[s]
            self.ends[slots] = (np.nan if device.timed
                                else device.durations(np.zeros(len(slots)), work[s]))
            if i % RELEASE_RANKS == RELEASE_RANKS - 1:
                self._release()

    def _network(self) -> tuple[Any, ...]:
        """Per simulated rank and stage of its pipeline, the link's id; per link
        its latency and ports; each send's slowdown in its event's ``ends`` slot."""
        net, pp = self.cluster.network, self.cluster.topo.pp
        ops = self.ops
        sends: dict[tuple[int, int], np.ndarray] = {}
        for s, (lo, hi) in enumerate(zip(ops["lo"], ops["hi"])):
            send = np.flatnonzero(ops["code"][lo:hi] == SEND) + lo
            to = self.msg_dst[ops["x"][send]]
            for d in range(pp):
                sends[(s, d)] = ops["ev"][send[to == d]]
        port_id: dict[int, int] = {}
        bandwidth: list[float] = []
        link_of = np.full(len(self.ranks) * pp, -1, np.int64)
        lat: list[float] = []
        pa: list[int] = []
        pb: list[int] = []
        for i, rank in enumerate(self.ranks):
            s = int(self.stage_of[i])
            base = i - s
            for d in range(pp):
                evs = sends[(s, d)]
                if not len(evs):
                    continue
                dst = self.ranks[base + d]
                link = net.link(rank, dst)
                if link.timed:
                    raise NotKernel("a slow link with an onset or an end")
                ports = []
                for port in link.ports:
                    if id(port) not in port_id:
                        port_id[id(port)] = len(bandwidth)
                        bandwidth.append(port.bandwidth)
                    ports.append(port_id[id(port)])
                link_of[i * pp + d] = len(lat)
                lat.append(net.latency(rank, dst))
                pa.append(ports[0])
                pb.append(ports[1])
                self.ends[self.ev_base[i] + evs] = link.slowdowns(np.zeros(len(evs)))
            if i % RELEASE_RANKS == RELEASE_RANKS - 1:
                self._release()
        self.port_bw = np.asarray(bandwidth or [1.0], np.float64)
        fixed = -1.0 if net.fixed_p2p_s is None else float(net.fixed_p2p_s)
        return (link_of, np.asarray(lat or [0.0], np.float64), np.asarray(pa or [0], np.int64),
                np.asarray(pb or [0], np.int64), self.port_bw, fixed)

    def _collectives(self) -> tuple[Any, ...]:
        """Rendezvous keys (as ``sim.engine.Engine._collectives``), rings and
        each random ring's slowest-edge multipliers, drawn in bulk."""
        topo, net, classes = self.cluster.topo, self.cluster.network, self.classes
        whole = sum(len(c) for c in classes.classes) == topo.dp * topo.tp  # else a part's
        rep_of = (classes.representative_rank() if classes.reduced and whole
                  else list(range(topo.world_size)))
        counts = [[sum(1 for op in st.ops if op[0] in (COLLECTIVE, ASYNC_COLLECTIVE)
                       and op[2] == kind) for kind in range(len(GROUP_KINDS))]
                  for st in self.program.stages]
        keys: dict[Any, int] = {}
        here = set(self.ranks)
        need: list[int] = []  # members of each rendezvous simulated here
        expected: list[int] = []  # and in all: more where a part of the job runs here
        rings: dict[int, tuple[int, Ring]] = {}
        draws: dict[int, int] = {}  # ring id -> collectives it prices
        counted: set[int] = set()
        coll_key = np.zeros(len(self.ranks) * 4, np.int64)
        ring_of = np.zeros(len(self.ranks) * 4, np.int64)
        for i, rank in enumerate(self.ranks):
            for kind in range(len(GROUP_KINDS)):
                key, members = classes.rendezvous(rank, kind, rep_of)
                if key not in keys:
                    keys[key] = len(keys)
                    stand_ins: tuple[int, ...] = cast(tuple, key)[1]
                    need.append(sum(1 for r in stand_ins if r in here))
                    expected.append(members)
                ring = net.ring(kind_group(topo, kind, rank))
                if id(ring) not in rings:
                    rings[id(ring)] = (len(rings), ring)
                r = rings[id(ring)][0]
                ck = keys[key]
                coll_key[i * 4 + kind], ring_of[i * 4 + kind] = ck, r
                if ck not in counted:
                    counted.add(ck)
                    draws[r] = draws.get(r, 0) + counts[self.stage_of[i]][kind]
        ordered = [ring for _r, ring in sorted(rings.values(), key=lambda x: x[0])]
        if any(ring.timed for ring in ordered):
            raise NotKernel("a slow link with an onset or an end on a collective's ring")
        lo, worst = [], []
        offset = 0
        for r, ring in enumerate(ordered):
            if ring.random and ring.n > 1:
                lo.append(offset)
                values = ring.worsts(draws.get(r, 0))
            else:
                lo.append(-1)
                values = ring.worsts(1)
            worst.append(values)
            offset += len(values)
        self.busy = np.zeros(len(keys))
        self.rendezvous_keys = list(keys)  # the job-wide names of the rendezvous, by id
        cross = np.asarray(expected, np.int64) > np.asarray(need, np.int64)
        ring_lo = np.asarray(lo, np.int64)
        const = np.array([w[0] if len(w) else 1.0 for w in worst], np.float64)
        return (coll_key, ring_of, np.asarray(need, np.int64), cross.astype(np.int64), len(keys),
                np.array([ring.n for ring in ordered], np.int64),
                np.array([ring.min_bandwidth for ring in ordered], np.float64),
                np.array([ring.latency_s for ring in ordered], np.float64),
                np.array([-1.0 if ring.fixed_s is None else ring.fixed_s for ring in ordered]),
                ring_lo, np.zeros(len(ordered), np.int64),
                np.concatenate(worst) if worst else np.zeros(1), const)

    def _state(self, n: int, slots: int, ports: int, n_keys: int) -> list[Any]:
        reg = np.zeros(K.N_REG, np.int64)
        reg[K.R_READY] = n
        reg[K.R_FREE_FLOW] = reg[K.R_FREE_RV] = reg[K.R_FREE_MEM] = -1
        flows, heap, rvs, members = 1024, 4096, 1024, 4096
        return [reg, np.zeros(n, np.int64), np.zeros(n), self.starts, self.ends,
                np.full(slots, -1.0), np.zeros(slots, np.uint8), np.full(slots, -1, np.int64),
                np.full(slots, -1, np.int64), np.arange(n - 1, -1, -1, dtype=np.int64),
                np.zeros(n, np.int64), np.zeros(n),
                np.zeros(heap), np.zeros(heap, np.int64), np.zeros(heap, np.int64),
                np.zeros(heap, np.int64),
                *self._flow_tables(flows), np.full(ports, -1, np.int64), np.zeros(ports, np.int64),
                np.full(2 * flows, -1, np.int64), np.full(2 * flows, -1, np.int64),
                np.zeros(flows, np.int64), np.zeros(flows, np.int64),
                np.full(n_keys, -1, np.int64), np.zeros(rvs, np.int64), np.zeros(rvs),
                np.full(rvs, -1, np.int64), np.full(rvs, -1, np.int64),
                np.zeros(members, np.int64), np.zeros(members, np.int64),
                np.full(members, -1, np.int64), np.zeros(rvs, np.int64),
                np.full(rvs, -1, np.int64), np.full(n, -1, np.int64), np.zeros(n_keys),
                np.zeros(members, np.int64), np.zeros(rvs, np.int64), np.array([-np.inf]),
                np.zeros(rvs, np.int64), np.zeros(rvs)]

    @staticmethod
    def _flow_tables(flows: int) -> list[np.ndarray]:
        """rem, rate, last, version, port a, port b, slot, sender, message, latency."""
        return [np.zeros(flows), np.zeros(flows), np.zeros(flows), np.zeros(flows, np.int64),
                np.zeros(flows, np.int64), np.zeros(flows, np.int64), np.zeros(flows, np.int64),
                np.zeros(flows, np.int64), np.zeros(flows, np.int64), np.zeros(flows)]

    # ---------------------------------------------------------------- run
    def run(self) -> None:
        """The whole job (every rendezvous is simulated here)."""
        if self.advance() is not None:
            raise AssertionError("a rendezvous awaited from elsewhere in a job simulated whole")
        self.check_done()

    def advance(self, horizon: float = -np.inf) -> list[Awaited] | None:
        """Go on until done (None) or until only rendezvous whose members
        elsewhere have not been heard of can let it go on: those, with their
        latest arrival here. ``horizon``: entries due until then may be taken
        meanwhile (the earliest instant due anywhere, every part stopped)."""
        total = int((self.ops["hi"] - self.ops["lo"])[self.stage_of].sum())
        self.state[46][0] = horizon
        while True:
            status = K.run_kernel(self.prog, self.net, self.coll, tuple(self.state))
            reg = self.state[0]
            if status == K.DONE:
                self._release()
                return None
            if status == K.EXCHANGE:
                self._release()
                return self._awaited()
            if status == K.PRICE:
                self._price_parked()
            elif status == K.PROGRESS:
                self._release()
                if self.progress is not None:
                    self.progress(int(reg[K.R_EXECUTED]), total)
                reg[K.R_EXECUTED] = 0
            else:
                self._grow()

    def next_due(self) -> float:
        """The earliest flow start or completion due here (inf: none)."""
        return float(self.state[12][0]) if self.state[0][K.R_HEAP] > 0 else np.inf

    def _awaited(self) -> list[Awaited]:
        st = self.state
        rvs = st[45][:int(st[0][K.R_AWAITED])]
        out = []
        for rv in rvs.tolist():
            member = int(st[37][st[35][rv]])
            rank = ~member if member < 0 else member
            ck = int(self.coll[0][rank * 4 + self.ops["x"][st[44][st[35][rv]]]])
            out.append(Awaited(self.rendezvous_keys[ck], int(st[40][rv]), float(st[34][rv])))
        return out

    def complete(self, key: Any, nth: int, latest: float) -> None:
        """The awaited rendezvous ``(key, nth)`` has every member, the latest at
        ``latest``: it ends when the loop goes on (in the order of these calls)."""
        st = self.state
        for rv, awaited in zip(st[45][:int(st[0][K.R_AWAITED])].tolist(), self._awaited()):
            if awaited.key == key and awaited.nth == nth:
                at = int(st[0][K.R_FINISH])
                st[47][at], st[48][at] = rv, latest
                st[0][K.R_FINISH] = at + 1
                return
        raise KeyError((key, nth))

    def check_done(self) -> None:
        """Raise ``CompiledDeadlock`` naming each rank that did not finish."""
        lengths = (self.ops["hi"] - self.ops["lo"])[self.stage_of]
        blocked = {self.ranks[i]: self._describe(i) for i in range(len(self.ranks))
                   if self.state[1][i] < lengths[i]}
        if blocked:
            raise CompiledDeadlock(blocked)

    def _price_parked(self) -> None:
        """Each parked rank's compute priced by its device at its start time; the
        ranks go on (the first parked first)."""
        reg, pc, ends = self.state[0], self.state[1], self.ends
        need_rank, need_start, ready = self.state[10], self.state[11], self.state[9]
        parked = int(reg[K.R_NEED])
        for j in range(parked):
            i = int(need_rank[j])
            k = int(self.ops["lo"][self.stage_of[i]] + pc[i])
            device = self.cluster.devices[self.ranks[i]]
            ends[self.ev_base[i] + self.ops["ev"][k]] = device.durations(
                np.array([need_start[j]]), np.array([self.ops["cost"][k]]))[0]
        n_ready = int(reg[K.R_READY])
        for j in range(parked - 1, -1, -1):
            ready[n_ready] = need_rank[j]
            n_ready += 1
        reg[K.R_READY] = n_ready
        reg[K.R_NEED] = 0

    def _grow(self) -> None:
        """Double every table that is (nearly) full."""
        st = self.state
        reg = st[0]
        heap = len(st[12])
        if reg[K.R_HEAP] + reg[K.R_NEXT_FLOW] + 4 >= heap:
            for j in range(12, 16):
                st[j] = np.concatenate((st[j], np.zeros_like(st[j])))
        flows = len(st[16])
        if reg[K.R_NEXT_FLOW] + 2 >= flows:
            for j in range(16, 26):
                st[j] = np.concatenate((st[j], np.zeros_like(st[j])))
            for j in (28, 29):
                st[j] = np.concatenate((st[j], np.full_like(st[j], -1)))
            for j in (30, 31):
                st[j] = np.concatenate((st[j], np.zeros_like(st[j])))
        rvs = len(st[33])
        if reg[K.R_NEXT_RV] + 2 >= rvs:
            for j in (33, 34, 35, 36, 40, 41, 45, 47, 48):
                st[j] = np.concatenate((st[j], np.full_like(st[j], -1) if j in (35, 36, 41)
                                        else np.zeros_like(st[j])))
        members = len(st[37])
        if reg[K.R_NEXT_MEM] + 2 >= members:
            for j in (37, 38, 39, 44):
                st[j] = np.concatenate((st[j], np.full_like(st[j], -1) if j == 39
                                        else np.zeros_like(st[j])))

    def _describe(self, i: int) -> str:
        k = int(self.ops["lo"][self.stage_of[i]] + self.state[1][i])
        code = int(self.ops["code"][k])
        if code in (COLLECTIVE, ASYNC_COLLECTIVE, COLLECTIVE_WAIT):
            return f"collective({GROUP_KINDS[int(self.ops['x'][k])]} group)"
        m = int(self.ops["x"][k])
        base = i - int(self.stage_of[i])
        src, dst = self.ranks[base + self.msg_src[m]], self.ranks[base + self.msg_dst[m]]
        return f"Recv(src={src})" if dst == self.ranks[i] else f"Wait(send to {dst})"

    # ------------------------------------------------------------- result
    def result(self) -> CompiledRun:
        pp = self.cluster.topo.pp
        per_stage = [st.events for st in self.program.stages]
        starts, ends = [], []
        for c in range(len(self.classes.classes)):
            lo = [int(self.ev_base[c * pp + s]) for s in range(pp)]
            starts.append(tuple(self.starts[a:a + per_stage[s]] for s, a in enumerate(lo)))
            ends.append(tuple(self.ends[a:a + per_stage[s]] for s, a in enumerate(lo)))
        return CompiledRun(self.program, self.cluster.topo, self.classes.classes, tuple(starts),
                           tuple(ends), self.spill.release if self.spill is not None else None)


def run_on_kernel(cluster: Cluster, program: PipeProgram, classes: PipeClasses,
                  progress: Callable[[int, int], None] | None = None,
                  op_overhead_s: float = 0.0) -> CompiledRun:
    engine = KernelRun(cluster, program, classes, progress, op_overhead_s)
    engine.run()
    return engine.result()
