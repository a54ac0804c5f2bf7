"""MegaFBD on the SimPy cluster: forward/backward workers on physical devices.

Worker threads are the "ranks" of the programs (``megatronapp.fbd.workers``).
Threads on one device take turns on its compute and exchange tensors through
shared memory (no link time). Collectives that cross devices go through one
bit-vector ``Coordinator`` per device: a periodic alignment round (an OR
all-reduce of the flattened table over all devices, priced like any small
all-reduce) finds the ready groups, and each device's control thread runs them
one after another in ascending group order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import simpy

from megatronapp import seeds
from megatronapp.config import ClockSkew, Scenario, ScenarioError, Throttle
from megatronapp.costs import stage_costs
from megatronapp.fbd.coordinator import Coordinator, GroupTable, or_tables
from megatronapp.fbd.hetero import (DeviceStats, PlanResult, busy_fraction, colocated_peak_bytes,
                                    fbd_device_peak_bytes, mean_iteration_s,
                                    useful_flops_per_iteration)
from megatronapp.fbd.ranks import FbdLayout, collective_groups
from megatronapp.fbd.run import (DeviceInfo, FbdRunResult, fbd_extra, fbd_settings,
                                 gpt_stage_flops, worker_clocks, worker_labels)
from megatronapp.fbd.workers import worker_programs
from megatronapp.layout import topology_of
from megatronapp.ops import AllReduce
from megatronapp.topology import Topology
from megatronapp.tracer import Event, RankClock, Tracer
from sim.cluster import Cluster, _link_faults
from sim.devices import Device, ThrottleWindow
from sim.hetero import ClassSlot, slots_by_class
from sim.network import Network

from .sim import SimBackend, run_sim


def fbd_layout(s: Scenario, colocated: bool = False) -> FbdLayout:
    forward_tp = s.parallel.tp if colocated else (fbd_settings(s).forward_tp or s.parallel.tp)
    return FbdLayout(topology_of(s), forward_tp=forward_tp, backward_tp=s.parallel.tp,
                     colocated=colocated)


def fbd_slots(s: Scenario, layout: FbdLayout) -> list[ClassSlot]:
    fbd = fbd_settings(s)
    return slots_by_class(s, [(fbd.forward_class, layout.forward_devices),
                              (fbd.backward_class, layout.backward_devices)])


def fbd_devices(s: Scenario, slots: list[ClassSlot], jitter: bool = True) -> dict[int, Device]:
    """Physical devices: their class's speed for the whole run, times any
    ``throttle`` fault on that device, plus background compute jitter."""
    windows: dict[int, list[ThrottleWindow]] = {
        d: [ThrottleWindow(0.0, math.inf, sl.slowdown)] if sl.slowdown != 1 else []
        for d, sl in enumerate(slots)}
    for f in s.faults:
        if isinstance(f, Throttle):
            end = math.inf if f.end_s is None else f.end_s
            windows[f.rank].append(ThrottleWindow(f.start_s, end, f.factor))
    sigma = s.cluster.jitter.compute_sigma if jitter else 0.0
    return {d: Device(d, tuple(ws), sigma,
                      seeds.rng(s.seed, 3, d) if sigma > 0 else None)
            for d, ws in windows.items()}


def device_clocks(s: Scenario, count: int) -> dict[int, RankClock]:
    clocks = {d: RankClock() for d in range(count)}
    for f in s.faults:
        if isinstance(f, ClockSkew):
            clocks[f.rank] = RankClock(f.offset_us, f.drift_ppm)
    return clocks


def device_cluster(s: Scenario, slots: list[ClassSlot], env: simpy.Environment,
                   faults: bool = True) -> Cluster:
    """A cluster whose "ranks" are physical devices of the given classes; with
    ``faults`` the scenario's faults and background jitter act on them."""
    topo = Topology(tp=len(slots), gpus_per_node=s.cluster.gpus_per_node)
    links = s.cluster.links
    quiet = s if faults else s.model_copy(update={"faults": ()})
    network = Network(env, topo, links.intra_node_gbps, links.inter_node_gbps,
                      links.latency_us * 1e-6, _link_faults(quiet),
                      s.cluster.jitter.link_sigma if faults else 0.0, s.seed,
                      s.costs.p2p_s, s.costs.allreduce_s)
    return Cluster(env, topo, fbd_devices(quiet, slots, jitter=faults), network,
                   device_clocks(quiet, len(slots)))


@dataclass
class _Pending:
    event: simpy.Event
    nbytes: int


class FbdSimBackend(SimBackend):
    """Interprets worker programs; ``rank`` in the handlers is a worker id."""

    def __init__(self, cluster: Cluster, layout: FbdLayout,
                 on_record: Callable[[int, Event], None] | None = None):
        super().__init__(cluster, on_record)
        self.layout = layout
        self.tracers = {w: Tracer(w, now=lambda: self.env.now, on_record=on_record)
                        for w in range(layout.num_workers)}
        self._compute_units = {d: simpy.Resource(self.env, 1) for d in range(layout.num_devices)}
        self.table = GroupTable(collective_groups(layout), layout.num_workers)
        self._gid = {g: i for i, g in enumerate(self.table.groups)}
        self.coordinators = {d: Coordinator(self.table, ws)
                             for d, ws in layout.workers_by_device.items()}
        self._waiting: dict[tuple[int, int], _Pending] = {}
        self._wake = self.env.event()
        self._control_free = {d: 0.0 for d in range(layout.num_devices)}
        table_bytes = math.ceil(len(self.table) * self.table.width / 8)
        self.round_s = cluster.network.ring_allreduce_s(tuple(self._compute_units), table_bytes)
        self.rounds = 0
        self.env.process(self._control_loop())

    def device(self, worker: int) -> int:
        return self.layout.device_of(self.layout.worker(worker))

    # ------------------------------------------------------------ compute
    def _compute(self, rank: int, op: Any):
        device = self.device(rank)
        with self._compute_units[device].request() as turn:  # threads share the device
            yield turn
            start = self.env.now
            yield self.env.timeout(self.cluster.devices[device].duration(start, op.cost_s))
        self.tracers[rank].record(op.name, start, self.env.now, op.meta)
        return op.run() if op.run is not None else None

    # ---------------------------------------------------------------- p2p
    def _transfer(self, src: int, dst: int, nbytes: int) -> simpy.Event:
        src_dev, dst_dev = self.device(src), self.device(dst)
        if src_dev == dst_dev:
            return self.env.timeout(0)  # threads on one device share its memory
        return self.cluster.network.transfer(src_dev, dst_dev, nbytes)

    # -------------------------------------------------------- collectives
    def _allreduce(self, rank: int, op: AllReduce):
        if rank not in op.group:
            raise ValueError(f"worker {rank} is not in all-reduce group {op.group}")
        gid = self._gid.get(op.group)
        if gid is None:
            raise ValueError(f"group {op.group} does not cross devices; no collective needed")
        start = self.env.now
        self.coordinators[self.device(rank)].register(rank, gid)
        key = (gid, self._seq[(rank, op.group)])
        self._seq[(rank, op.group)] += 1
        pending = self._waiting.setdefault(key, _Pending(self.env.event(), op.nbytes))
        if not self._wake.triggered:
            self._wake.succeed()
        yield pending.event
        self.tracers[rank].record(op.name, start, self.env.now,
                                  {**op.meta, "bytes": op.nbytes, "group": list(op.group)})
        return op.tensor

    def _control_loop(self):
        """Alignment rounds while any request is registered."""
        while True:
            if not any(c.pending_groups() for c in self.coordinators.values()):
                self._wake = self.env.event()
                yield self._wake
            yield self.env.timeout(self.round_s)
            merged = or_tables([c.begin_round() for c in self.coordinators.values()])
            launches = {d: c.finish_round(merged) for d, c in self.coordinators.items()}
            self.rounds += 1
            ready = sorted({(l.group, l.seq) for ls in launches.values() for l in ls})
            for gid, seq in ready:  # ascending group order on every control thread
                self._execute(gid, seq)

    def _execute(self, gid: int, seq: int) -> None:
        pending = self._waiting.pop((gid, seq))
        devices = self.layout.devices_of(self.table.groups[gid])
        start = max([self.env.now] + [self._control_free[d] for d in devices])
        end = start + self.cluster.network.ring_allreduce_s(devices, pending.nbytes)
        for d in devices:
            self._control_free[d] = end
        self.env.timeout(end - self.env.now).callbacks.append(
            lambda _e: pending.event.succeed())


@dataclass(frozen=True)
class FbdRun:
    layout: FbdLayout
    slots: tuple[ClassSlot, ...]
    events: dict[int, list[Event]]  # worker id -> events
    rounds: int


def run_fbd(s: Scenario, stage_for: Any = None,
            on_record: Callable[[int, Event], None] | None = None) -> FbdRun:
    """Simulate the decoupled job of a scenario on its device classes."""
    layout = fbd_layout(s)
    slots = fbd_slots(s, layout)
    cluster = device_cluster(s, slots, simpy.Environment())
    backend = FbdSimBackend(cluster, layout, on_record)
    programs = worker_programs(layout, stage_costs(s), s.parallel.microbatches, s.iterations,
                               stage_for)
    events = backend.run(programs)
    return FbdRun(layout, tuple(slots), events, backend.rounds)


def check_fbd_scenario(s: Scenario) -> None:
    if s.parallel.vpp != 1:
        raise ScenarioError("parallel.vpp", "MegaFBD workers run one model chunk per stage")


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
    extra = fbd_extra(s, layout, devices, run.events, "analytic", gpt_stage_flops(s),
                      coordinator_rounds=run.rounds, memory="modelled")
    return FbdRunResult("sim", topology_of(s), run.events, worker_clocks(layout, cluster_clocks),
                        extra, labels=worker_labels(layout, [sl.name for sl in run.slots]))


# ------------------------------------------------------------ comparison
def _fbd_plan(s: Scenario, name: str) -> PlanResult:
    run = run_fbd(s)
    layout = run.layout
    wall = mean_iteration_s(run.events)
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
    wall = mean_iteration_s(result.events)
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
