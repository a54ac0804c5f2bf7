"""Per-device throughput and peak memory of decoupled vs co-located runs.

Pure functions over trace events (no simulation here): backends produce the
events, these turn them into the numbers of the comparison table.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import fmean
from typing import Iterable, Mapping, Sequence

from megatronapp.scenario.config import Scenario, ScenarioError
from megatronapp.costs.per_op import StageCosts, layer_forward_flops
from megatronapp.trace.summary import iteration_spans
from megatronapp.trace.events import Event

from .ranks import FbdLayout, Worker


def peak_outstanding(ups: Iterable[float], downs: Iterable[float]) -> int:
    """Most items alive at once: +1 at each ``up`` time, -1 at each ``down``
    (a down at the same instant as an up is applied first)."""
    points = sorted([(t, 0) for t in downs] + [(t, 1) for t in ups])
    alive = peak = 0
    for _, kind in points:
        alive += 1 if kind else -1
        peak = max(peak, alive)
    return peak


def ends(events: Iterable[Event], name: str) -> list[float]:
    return [e.end_s for e in events if e.name == name]


def useful_flops_per_iteration(s: Scenario, global_microbatches: int) -> float:
    """Model FLOPs of forward + backward (3x forward), recomputation excluded."""
    m = s.model
    logits = 2 * m.micro_batch_size * m.seq_len * m.hidden * m.vocab
    return 3 * global_microbatches * (m.layers * layer_forward_flops(s) + logits)


@dataclass(frozen=True)
class DeviceStats:
    device: int
    device_class: str
    role: str  # "F", "B" or "FB" (co-located)
    busy_fraction: float
    peak_memory_bytes: float
    memory_bytes: float

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.memory_bytes


@dataclass(frozen=True)
class PlanResult:
    """One placement on one cluster: its devices and its iteration time."""

    name: str
    iteration_s: float
    useful_flops: float  # per iteration
    devices: tuple[DeviceStats, ...]

    @property
    def flops_per_device(self) -> float:
        return self.useful_flops / self.iteration_s / len(self.devices)

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    def peak_by_class(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for d in self.devices:
            out[d.device_class] = max(out.get(d.device_class, 0.0), d.peak_memory_bytes)
        return out


def iteration_periods(events: Mapping[int, Sequence[Event]]) -> list[float]:
    """Time from the previous iteration's end to this one's (the first from the
    run's start). A decoupled forward worker starts iteration i+1 before
    iteration i has ended, so spans would overlap; periods add up to the run."""
    start = min((e.start_s for evs in events.values() for e in evs), default=0.0)
    ends = [end for _, end in iteration_spans(events).values()]
    return [b - a for a, b in zip([start] + ends[:-1], ends)]


def steady_iteration_s(events: Mapping[int, Sequence[Event]]) -> float:
    """The iteration time of a run: the mean period after the first iteration
    (whose period includes the pipeline fill), decoupled or co-located alike."""
    periods = iteration_periods(events)
    return fmean(periods[1:]) if len(periods) > 1 else periods[0]


def busy_fraction(events: Iterable[Event], wall_s: float) -> float:
    busy = sum(e.dur_s for e in events if e.name in ("forward", "backward", "recompute_forward",
                                                     "optimizer"))
    return busy / wall_s if wall_s > 0 else 0.0


def colocated_peak_bytes(costs: StageCosts, events: Sequence[Event]) -> float:
    """Model states plus the most microbatches whose activations wait for backward."""
    in_flight = peak_outstanding(ends(events, "forward"), ends(events, "backward"))
    return costs.model_mem_bytes + in_flight * costs.activation_mem_bytes_per_chunk


def forward_worker_bytes(costs: StageCosts) -> float:
    """bf16 weights and the activation in hand; no autograd graph is kept."""
    return costs.params_per_rank * 2 + 2 * costs.activation_bytes


def backward_worker_bytes(costs: StageCosts, forward_events: Sequence[Event],
                          backward_events: Sequence[Event]) -> float:
    """Model states, one recomputed microbatch, and stage inputs delivered by the
    forward worker but not yet consumed."""
    waiting = peak_outstanding(ends(forward_events, "send_input"),
                               ends(backward_events, "recv_input"))
    return (costs.model_mem_bytes + costs.activation_mem_bytes_per_chunk
            + waiting * costs.activation_bytes)


def format_table(rows: Sequence[tuple[str, Sequence[PlanResult]]]) -> str:
    """One block per cluster: each plan against the block's first plan."""
    header = (f"{'cluster':<24} {'plan':<30} {'iter ms':>9} {'TFLOPS/dev':>10} {'vs base':>8} "
              f"{'peak GB by class':<28} fits")
    lines = [header, "-" * len(header)]
    for cluster, plans in rows:
        base = plans[0].flops_per_device
        for plan in plans:
            peaks = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in sorted(plan.peak_by_class().items()))
            lines.append(f"{cluster:<24} {plan.name:<30} {plan.iteration_s * 1e3:9.2f} "
                         f"{plan.flops_per_device / 1e12:10.1f} "
                         f"{(plan.flops_per_device / base - 1) * 100:+7.1f}% {peaks:<28} "
                         f"{'yes' if plan.fits else 'OOM'}")
    return "\n".join(lines)


def fbd_device_peak_bytes(costs: StageCosts, layout: FbdLayout,
                          events: Mapping[int, Sequence[Event]]) -> dict[int, float]:
    """Modelled peak memory of every device of a decoupled run (its workers summed)."""
    peaks: dict[int, float] = {}
    for device, workers in layout.workers_by_device.items():
        peak = 0.0
        for w in workers:
            worker = layout.worker(w)
            if worker.phase == "F":
                peak += forward_worker_bytes(costs)
            else:
                fwd = events[layout.worker_id(Worker("F", worker.vrank))]
                peak += backward_worker_bytes(costs, fwd, events[w])
        peaks[device] = peak
    return peaks


def backward_worker_bound_bytes(costs: StageCosts, microbatches: int) -> float:
    """A backward worker's most: model states, one recomputed microbatch and
    every stage input of one iteration waiting (a forward worker cannot run
    further ahead: it waits for the weights of the previous step)."""
    return (costs.model_mem_bytes + costs.activation_mem_bytes_per_chunk
            + microbatches * costs.activation_bytes)


def fbd_memory_bound_bytes(costs: StageCosts, layout: FbdLayout,
                           microbatches: int) -> dict[int, float]:
    """Per device, the most its workers can hold at once, known before running."""
    return {device: sum(forward_worker_bytes(costs) if layout.worker(w).phase == "F"
                        else backward_worker_bound_bytes(costs, microbatches) for w in workers)
            for device, workers in layout.workers_by_device.items()}


def check_fbd_memory(s: Scenario, costs: StageCosts, layout: FbdLayout,
                     capacities: Sequence[tuple[str, float]]) -> None:
    """Refuse a placement whose workers cannot fit a device (``capacities``:
    per device, its class name and memory in bytes)."""
    field = "cluster.device_classes" if s.cluster.device_classes else "cluster.gpu.memory_gb"
    bounds = fbd_memory_bound_bytes(costs, layout, s.parallel.microbatches)
    for device, need in bounds.items():
        name, capacity = capacities[device]
        if need > capacity:
            role = "forward" if layout.phase_of_device(device) == "F" else "backward"
            raise ScenarioError(field, f"MegaFBD needs {need / 1e9:.2f} GB on device {device} "
                                f"({role}, class {name}) at its peak, the device has "
                                f"{capacity / 1e9:.2f} GB")
