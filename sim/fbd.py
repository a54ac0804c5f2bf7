"""MegaFBD on the SimPy cluster: forward/backward workers on physical devices.

Worker programs are the "ranks". Workers on one device take turns on its
compute. Every worker has a control thread running the production round
loop (``megatronapp.fbd.control.control_thread``), as every worker process
does on torch: its cross-device p2p operations and DP all-reduces are
coordinator requests; a round is an OR all-reduce over all control threads
(priced as a small all-reduce of the encoded table, completing when the last
control thread has entered it); ready operations run on the control threads
in ascending group order, each one a blocking rendezvous of its members'
control threads priced by the network. TP all-reduces are the model's own
(inside megatron-core's layers on torch) and meet directly.

Rounds in which nothing can change (nothing registered or finished since the
last snapshot, nothing ran) are skipped to the first round after the next
change, with the same timing the round loop would have had, so a long
simulated wait costs a few rounds rather than one per nap.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import simpy

from megatronapp.faults import JobEffects, Throttle
from megatronapp.scenario.config import Scenario, ScenarioError
from megatronapp.costs.per_op import stage_costs
from megatronapp.fbd.control import Align, Aligned, Execute, Nap, Requests, control_thread
from megatronapp.fbd.coordinator import Coordinator, GroupTable, or_tables
from megatronapp.fbd.hetero import (DeviceStats, PlanResult, busy_fraction, check_fbd_memory,
                                    colocated_peak_bytes, fbd_device_peak_bytes,
                                    steady_iteration_s, useful_flops_per_iteration)
from megatronapp.fbd.ranks import FbdLayout, coordinated_groups
from megatronapp.fbd.run import (DeviceInfo, FbdRunResult, fbd_layout, fbd_programs, fbd_section,
                                 fbd_settings, gpt_stage_flops, worker_clocks, worker_labels)
from megatronapp.fbd.transport import table_bytes
from megatronapp.program.layout import topology_of
from megatronapp.parallel.ops import AllReduce, Compute, IRecv, ISend, RankProgram, trace_args
from megatronapp.parallel.topology import Topology
from megatronapp.trace.events import Event, RankClock, Tracer
from .cluster import Cluster, clocks_of, device_of, scenario_effects
from .devices import Device
from .hetero import ClassSlot, slots_by_class
from .interpreter import SimInterpreter
from .network import Network
from .run import run_sim


def fbd_slots(s: Scenario, layout: FbdLayout) -> list[ClassSlot]:
    fbd = fbd_settings(s)
    return slots_by_class(s, [(fbd.forward_class, layout.forward_devices),
                              (fbd.backward_class, layout.backward_devices)])


def fbd_devices(s: Scenario, slots: list[ClassSlot], jitter: bool = True,
                effects: JobEffects | None = None) -> dict[int, Device]:
    """Physical devices: their class's speed for the whole run, times the
    faults on that device, plus background compute jitter."""
    effects = effects or scenario_effects(s)
    return {d: device_of(s, effects, d, jitter, sl.slowdown) for d, sl in enumerate(slots)}


def device_clocks(s: Scenario, count: int) -> dict[int, RankClock]:
    return clocks_of(s, count)


def device_cluster(s: Scenario, slots: list[ClassSlot], env: simpy.Environment,
                   faults: bool = True) -> Cluster:
    """A cluster whose "ranks" are physical devices of the given classes; with
    ``faults`` the scenario's faults and background jitter act on them."""
    topo = Topology(tp=len(slots), gpus_per_node=s.cluster.gpus_per_node)
    links = s.cluster.links
    quiet = s if faults else s.model_copy(update={"faults": ()})
    effects = scenario_effects(quiet)
    network = Network(env, topo, links.intra_node_gbps, links.inter_node_gbps,
                      links.latency_us * 1e-6, effects,
                      s.cluster.jitter.link_sigma if faults else 0.0, s.seed,
                      s.costs.p2p_s, s.costs.allreduce_s)
    return Cluster(env, topo, fbd_devices(quiet, slots, faults, effects), network,
                   clocks_of(quiet, len(slots), effects), effects)


@dataclass(eq=False)
class _Request:
    """One worker's side of a coordinated operation."""

    kind: str  # "send" | "recv" | "allreduce"
    nbytes: int
    value: Any
    done: simpy.Event


@dataclass(eq=False)
class _Round:
    """The alignment all-reduce being entered by the control threads."""

    event: simpy.Event
    tables: list[tuple[int, ...]] = field(default_factory=list)
    active: bool = False
    changes: int = -1  # changes seen by the first snapshot


@dataclass(eq=False)
class _Meeting:
    """Members' control threads arriving at one launched operation."""

    event: simpy.Event
    requests: dict[int, _Request] = field(default_factory=dict)


class FbdInterpreter(SimInterpreter):
    """Interprets worker programs and their control threads; ``rank`` in the
    handlers is a worker id."""

    def __init__(self, cluster: Cluster, layout: FbdLayout, nap_s: float,
                 on_record: Callable[[int, Event], None] | None = None,
                 skip_idle_rounds: bool = True):
        super().__init__(cluster, on_record)
        self.layout, self.nap_s, self.skip_idle_rounds = layout, nap_s, skip_idle_rounds
        self.tracers = {w: Tracer(w, now=lambda: self.env.now, on_record=on_record)
                        for w in range(layout.num_workers)}
        self._compute_units = {d: simpy.Resource(self.env, 1) for d in range(layout.num_devices)}
        self.table = GroupTable(coordinated_groups(layout), layout.num_workers)
        self._gid = {g: i for i, g in enumerate(self.table.groups)}
        self.requests = {w: Requests[_Request](Coordinator(self.table, [w]))
                         for w in range(layout.num_workers)}
        self._running: set[int] = set()
        self._round = _Round(self.env.event())
        self._meetings: dict[tuple[int, int], _Meeting] = {}
        self._changes = 0  # posts and finished workers: what can make a round differ
        self._quiet_after: int | None = None  # changes seen by the last empty round
        self._wake = self.env.event()
        devices = tuple(range(layout.num_devices))
        self.round_s = cluster.network.ring_allreduce_s(devices, table_bytes(self.table))
        self.rounds = 0  # the round loop's rounds, skipped ones included
        self.simulated_rounds = 0  # those this simulation really ran

    def device(self, worker: int) -> int:
        return self.layout.device_of(self.layout.worker(worker))

    def run(self, programs: dict[int, RankProgram]) -> dict[int, list[Event]]:
        self._running = set(programs)
        for w in range(self.layout.num_workers):
            self.env.process(self._control(w))
        return super().run({w: self._finishing(w, p) for w, p in programs.items()})

    def _finishing(self, worker: int, program: RankProgram) -> RankProgram:
        yield from program
        self._running.discard(worker)
        self._changed()

    def _changed(self) -> None:
        self._changes += 1
        if not self._wake.triggered:
            self._wake.succeed()

    # ------------------------------------------------------------ compute
    def _compute(self, rank: int, op: Compute):
        device = self.device(rank)
        iteration = op.meta.get("iteration", -1)
        stall = self.cluster.devices[device].host_delay_s(op.name, iteration)
        if stall > 0:  # the host is late to issue it; the device stays free meanwhile
            yield self.env.timeout(stall)
        with self._compute_units[device].request() as turn:  # threads share the device
            yield turn
            start = self.env.now
            yield self.env.timeout(self.cluster.devices[device].duration(start, op.cost_s,
                                                                         iteration))
        result = op.run() if op.run is not None else None
        self.tracers[rank].record(op.name, start, self.env.now, trace_args(op, result=result))
        return result

    # ------------------------------------------------- coordinated requests
    def _post(self, worker: int, kind: str, members: tuple[int, ...], nbytes: int, value: Any,
              ) -> simpy.Event:
        gid = self._gid.get(members)
        if gid is None:
            raise ValueError(f"workers {members} exchange nothing across devices")
        request = _Request(kind, nbytes, value, self.env.event())
        self.requests[worker].post(worker, gid, request)
        self._changed()
        return request.done

    def _traced(self, rank: int, done: simpy.Event, op: ISend | IRecv) -> simpy.Event:
        start, args = self.env.now, trace_args(op)

        def record(_e: simpy.Event) -> None:
            self.tracers[rank].record(op.name, start, self.env.now, args)

        done.callbacks.append(record)
        return done

    def _isend(self, rank: int, op: ISend):
        done = self._post(rank, "send", tuple(sorted((rank, op.dst))), op.nbytes, op.tensor)
        return self._traced(rank, done, op)
        yield  # pragma: no cover - makes this a generator

    def _irecv(self, rank: int, op: IRecv):
        done = self._post(rank, "recv", tuple(sorted((rank, op.src))), op.nbytes, None)
        return self._traced(rank, done, op)
        yield  # pragma: no cover

    def _allreduce(self, rank: int, op: AllReduce):
        if op.group not in self._gid:  # the model's own TP collective meets directly
            return (yield from super()._allreduce(rank, op))
        start = self.env.now
        yield self._post(rank, "allreduce", op.group, op.nbytes, op.tensor)
        self.tracers[rank].record(op.name, start, self.env.now, trace_args(op))
        return op.tensor

    def _ring_s(self, group: tuple[int, ...], nbytes: int, kind: str = "all_reduce") -> float:
        return self.cluster.network.ring_collective_s(kind, self.layout.devices_of(group), nbytes)

    # ------------------------------------------------------ control threads
    def _control(self, worker: int):
        program = control_thread(self.requests[worker], lambda: worker in self._running,
                                 self.nap_s)
        reply: Any = None
        while True:
            try:
                op = program.send(reply)
            except StopIteration:
                return
            if isinstance(op, Align):
                reply = yield from self._align(op)
            elif isinstance(op, Execute):
                reply = yield from self._execute(worker, op)
            else:
                reply = yield from self._nap(worker, op)

    def _align(self, op: Align):
        rnd = self._round
        if not rnd.tables:
            rnd.changes = self._changes
        rnd.tables.append(op.table)
        rnd.active |= op.active
        if len(rnd.tables) == self.layout.num_workers:  # the last one in: the round runs
            self._round = _Round(self.env.event())
            merged = or_tables(rnd.tables)
            self.rounds += 1
            self.simulated_rounds += 1
            ready = any(merged[g] == self.table.expected[g] for g in range(len(merged)))
            self._quiet_after = None if ready else rnd.changes

            def deliver(_e: simpy.Event) -> None:
                rnd.event.succeed(Aligned(merged, rnd.active))

            self.env.timeout(self.round_s).callbacks.append(deliver)
        return (yield rnd.event)

    def _execute(self, worker: int, op: Execute[_Request]):
        launch = op.launch
        meeting = self._meetings.setdefault((launch.group, launch.seq),
                                            _Meeting(self.env.event()))
        (request,) = op.requests  # one worker per control thread
        meeting.requests[worker] = request
        members = self.table.groups[launch.group]
        if len(meeting.requests) == len(members):
            del self._meetings[(launch.group, launch.seq)]
            self._run_launched(members, meeting)
        yield meeting.event
        return None

    def _run_launched(self, members: tuple[int, ...], meeting: _Meeting) -> None:
        requests = meeting.requests
        senders = [w for w, r in requests.items() if r.kind == "send"]
        if senders:  # point to point: the sender's payload to the receiver
            (sender,) = senders
            receiver = next(w for w in members if w != sender)
            moved = self.cluster.network.transfer(self.device(sender), self.device(receiver),
                                                  requests[sender].nbytes)
            values = {sender: None, receiver: requests[sender].value}
        else:
            nbytes = requests[members[0]].nbytes
            moved = self.env.timeout(self._ring_s(members, nbytes))
            values = {w: r.value for w, r in requests.items()}

        def finish(_e: simpy.Event) -> None:
            for w, r in requests.items():
                r.done.succeed(values[w])
            meeting.event.succeed()

        moved.callbacks.append(finish)

    def _nap(self, worker: int, op: Nap):
        yield self.env.timeout(op.seconds)
        if not self.skip_idle_rounds or self._quiet_after != self._changes:
            return None
        # Nothing changed since the last (empty) round: the rounds until the
        # next change would be empty too. Resume on the round grid after it.
        arrival, period = self.env.now, op.seconds + self.round_s
        if self._wake.triggered:
            self._wake = self.env.event()
        yield self._wake
        skipped = math.ceil((self.env.now - arrival) / period)
        if worker == 0:
            self.rounds += skipped
        yield self.env.timeout(arrival + skipped * period - self.env.now)
        return None


@dataclass(frozen=True)
class FbdRun:
    layout: FbdLayout
    slots: tuple[ClassSlot, ...]
    events: dict[int, list[Event]]  # worker id -> events
    rounds: int
    simulated_rounds: int


def run_fbd(s: Scenario, stage_for: Any = None,
            on_record: Callable[[int, Event], None] | None = None,
            skip_idle_rounds: bool = True) -> FbdRun:
    """Simulate the decoupled job of a scenario on its device classes
    (``skip_idle_rounds=False`` simulates every empty round, for checking)."""
    layout = fbd_layout(s)
    slots = fbd_slots(s, layout)
    cluster = device_cluster(s, slots, simpy.Environment())
    interpreter = FbdInterpreter(cluster, layout, fbd_settings(s).round_nap_s, on_record,
                                 skip_idle_rounds)
    events = interpreter.run(fbd_programs(s, stage_for))
    return FbdRun(layout, tuple(slots), events, interpreter.rounds, interpreter.simulated_rounds)


def check_fbd_scenario(s: Scenario) -> None:
    """What a decoupled run needs before it starts: one chunk per stage and
    every device's workers within its memory."""
    if s.parallel.vpp != 1:
        raise ScenarioError("parallel.vpp", "MegaFBD workers run one model chunk per stage")
    layout = fbd_layout(s)
    slots = fbd_slots(s, layout)
    check_fbd_memory(s, stage_costs(s), layout, [(sl.name, sl.memory_bytes) for sl in slots])


def progress_hook(layout: FbdLayout, on_record: Callable[[int, Event], None] | None
                  ) -> Callable[[int, Event], None] | None:
    """Hand the caller the first backward worker's events as rank 0's: that is
    where an iteration's optimizer step shows (forward workers have none)."""
    if on_record is None:
        return None
    first_backward = layout.virtual_ranks

    def hook(worker: int, event: Event) -> None:
        if worker == first_backward:
            on_record(0, event)

    return hook


def run_fbd_scenario(s: Scenario, on_record: Callable[[int, Event], None] | None = None
                     ) -> FbdRunResult:
    """``megatronapp run`` of a scenario with an ``fbd`` section: one trace
    process per worker, summary keys from ``megatronapp.fbd.run``."""
    check_fbd_scenario(s)
    layout = fbd_layout(s)
    run = run_fbd(s, on_record=progress_hook(layout, on_record))
    peaks = fbd_device_peak_bytes(stage_costs(s), layout, run.events)
    devices = [DeviceInfo(sl.name, sl.memory_bytes, peaks[d]) for d, sl in enumerate(run.slots)]
    cluster_clocks = device_clocks(s, layout.num_devices)
    section = fbd_section(s, layout, devices, run.events, "analytic", gpt_stage_flops(s),
                          coordinator_rounds=run.rounds, memory="modelled")
    return FbdRunResult("sim", topology_of(s), run.events, worker_clocks(layout, cluster_clocks),
                        fbd=section, labels=worker_labels(layout, [sl.name for sl in run.slots]))


# ------------------------------------------------------------ comparison
def _fbd_plan(s: Scenario, name: str) -> PlanResult:
    run = run_fbd(s)
    layout = run.layout
    wall = steady_iteration_s(run.events)
    peaks = fbd_device_peak_bytes(stage_costs(s), layout, run.events)
    stats = []
    for device, workers in layout.workers_by_device.items():
        events = [e for w in workers for e in run.events[w]]
        stats.append(_stats(device, run.slots[device], layout.phase_of_device(device),
                            events, wall, s.iterations, peaks[device]))
    flops = useful_flops_per_iteration(s, s.parallel.microbatches * s.parallel.dp)
    return PlanResult(name, wall, flops, tuple(stats))


def _stats(device: int, slot: ClassSlot, role: str, events: list[Event], wall: float,
           iterations: int, peak: float) -> DeviceStats:
    return DeviceStats(device, slot.name, role, busy_fraction(events, wall * iterations), peak,
                       slot.memory_bytes)


def colocated_scenario(s: Scenario, devices: int) -> Scenario:
    """Megatron on ``devices`` devices: dp widened, the same global batch."""
    p = s.parallel
    dp, rem = divmod(devices, p.tp * p.pp)
    global_mb = p.microbatches * p.dp
    if rem or global_mb % dp:
        raise ScenarioError("parallel", f"{devices} devices cannot run tp {p.tp} x pp {p.pp} "
                            f"with {global_mb} microbatches split evenly over data parallelism")
    data = s.model_dump(mode="json")
    data["parallel"].update(dp=dp, microbatches=global_mb // dp)
    # ordinary training on the classes' speeds; fault ranks name FBD devices
    data.update(schedule="1f1b", fbd=None, faults=[])
    return Scenario.model_validate(data)


def _colocated_plan(s: Scenario, name: str, slots: list[ClassSlot]) -> PlanResult:
    base = colocated_scenario(s, len(slots))
    faults = [Throttle(kind="throttle", rank=d, factor=sl.slowdown)
              for d, sl in enumerate(slots) if sl.slowdown != 1]
    base = base.model_copy(update={"faults": tuple(faults)})
    result = run_sim(base)
    costs = stage_costs(base)
    wall = steady_iteration_s(result.events)
    stats = tuple(_stats(r, slots[r], "FB", result.events[r], wall, base.iterations,
                         colocated_peak_bytes(costs, result.events[r])) for r in result.events)
    flops = useful_flops_per_iteration(s, s.parallel.microbatches * s.parallel.dp)
    return PlanResult(name, wall, flops, stats)


def swapped(s: Scenario) -> Scenario:
    own = fbd_settings(s)
    fbd = own.model_copy(update={"forward_class": own.backward_class,
                                 "backward_class": own.forward_class})
    return s.model_copy(update={"fbd": fbd})


def compare_plans(s: Scenario) -> list[PlanResult]:
    """Co-located Megatron on the devices MegaFBD occupies, co-located on the
    backward class alone, MegaFBD as configured and with classes swapped."""
    check_fbd_scenario(s)
    layout = fbd_layout(s)
    slots = fbd_slots(s, layout)
    f_cls, b_cls = slots[0].name, slots[-1].name
    plans = [_colocated_plan(s, "co-located, all devices", slots),
             _colocated_plan(s, f"co-located, {b_cls} only", slots[layout.forward_devices:]),
             _fbd_plan(s, f"FBD F->{f_cls} B->{b_cls}")]
    if f_cls != b_cls:
        plans.append(_fbd_plan(swapped(s), f"FBD F->{b_cls} B->{f_cls}"))
    return plans
