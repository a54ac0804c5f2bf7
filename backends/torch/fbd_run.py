"""``megatronapp run --backend torch`` of a scenario with an ``fbd`` section.

One gloo process per physical device, worker threads and a control thread in
each (``backends/torch/fbd.py``). The stages are the small float64 MLPs of
``fbd_train`` shaped by the scenario (hidden size, layers per stage, tokens per
microbatch as rows), not megatron-core GPT stages: megatron-core keeps its
parallel state in process globals, which the forward and backward workers of
several virtual ranks, running as threads of one process, cannot share. The
summary says so (``fbd.stages: "mlp"``).

Faults act on physical devices as in simulation: a device class slower than
``cluster.gpu`` and a ``throttle`` stretch that device's compute, slow links
and collectives are priced by the simulator's network over the devices.
"""
from __future__ import annotations

from functools import partial
from statistics import fmean
from typing import Any, Callable

import simpy

from backends.sim_fbd import (check_fbd_scenario, device_clocks, device_cluster, fbd_devices,
                              fbd_layout, fbd_slots, progress_hook)
from megatronapp.config import Scenario, ScenarioError
from megatronapp.fbd.ranks import FbdLayout
from megatronapp.fbd.run import DeviceInfo, FbdRunResult, fbd_extra, worker_clocks, worker_labels
from megatronapp.tracer import Event

from .faults import InjectedFaults
from .fbd_train import DeviceResult, MlpSpec, run_decoupled

MLP_LR = 0.05


def mlp_spec(s: Scenario) -> MlpSpec:
    p, m = s.parallel, s.model
    return MlpSpec(hidden=m.hidden, layers_per_stage=m.layers // p.pp, pp=p.pp, dp=p.dp,
                   microbatches=p.microbatches, batch=m.micro_batch_size * m.seq_len,
                   iterations=s.iterations, lr=MLP_LR, seed=s.seed)


def mlp_stage_flops(spec: MlpSpec) -> list[float]:
    """Forward FLOPs of one microbatch per stage: a (rows x h) @ (h x h) per layer."""
    return [2.0 * spec.batch * spec.hidden ** 2 * spec.layers_per_stage] * spec.pp


def check_torch_fbd(s: Scenario) -> None:
    check_fbd_scenario(s)
    if s.parallel.tp != 1:
        raise ScenarioError("parallel.tp", f"{s.parallel.tp}: the torch MegaFBD runtime runs "
                            "tp = 1 workers (forward TP packing is modelled in simulation only)")


def device_faults(s: Scenario, device: int) -> InjectedFaults:
    """One device's injected faults (called inside its spawned process)."""
    layout = fbd_layout(s)
    slots = fbd_slots(s, layout)
    faulty = device_cluster(s, slots, simpy.Environment())
    nominal = device_cluster(s, slots, simpy.Environment(), faults=False)
    # class speed and throttles; background jitter a real machine brings itself
    return InjectedFaults(fbd_devices(s, slots, jitter=False)[device], faulty.network,
                          nominal.network)


def _loss_per_iteration(results: list[DeviceResult]) -> list[float]:
    losses: dict[int, list[float]] = {}
    for r in results:
        for log in r.logs.values():
            for it, per_mb in log.losses.items():
                losses.setdefault(it, []).extend(per_mb.values())
    return [fmean(losses[it]) for it in sorted(losses)]


def run_fbd_scenario(s: Scenario, on_record: Callable[[int, Event], None] | None = None,
                     **kw: Any) -> FbdRunResult:
    """Train the scenario decoupled on real processes; ``kw``: ``encoding``
    ("bits" | "words", the coordinator's OR all-reduce), ``timeout_s``."""
    check_torch_fbd(s)
    layout: FbdLayout = fbd_layout(s)
    slots = fbd_slots(s, layout)
    spec = mlp_spec(s)
    results = run_decoupled(spec, layout, kw.get("encoding", "bits"),
                            kw.get("timeout_s", 300.0), partial(device_faults, s), trace=True)
    events = {w: evs for r in results for w, evs in r.events.items()}
    hook = progress_hook(layout, on_record)
    if hook is not None:  # progress arrives at the end: events live in other processes
        for w in sorted(events):
            for e in events[w]:
                hook(w, e)
    devices = [DeviceInfo(sl.name, sl.memory_bytes, float(r.peak_rss_bytes))
               for sl, r in zip(slots, results)]
    extra = fbd_extra(s, layout, devices, events, "mlp", mlp_stage_flops(spec),
                      coordinator_rounds=max(r.rounds for r in results),
                      memory="measured process peak RSS")
    extra["loss_per_iteration"] = _loss_per_iteration(results)
    clocks = worker_clocks(layout, device_clocks(s, layout.num_devices))
    return FbdRunResult("torch", layout.topo, events, clocks, extra,
                        labels=worker_labels(layout, [sl.name for sl in slots]))
