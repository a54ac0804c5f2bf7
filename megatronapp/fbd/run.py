"""A decoupled run as a normal run directory: labels, iteration times, the
``fbd`` section of summary.json. Pure functions over worker events, shared by
every backend.

The trace has one Chrome process per *worker* (pid = worker id: forward
workers 0..N-1, backward workers N..2N-1); its name says the phase, the
virtual rank and the physical device it ran on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from megatronapp.scenario.config import Fbd, Scenario
from megatronapp.costs.per_op import layer_forward_flops, stage_costs
from megatronapp.trace.kinds import COMPUTE_NAMES
from megatronapp.program.layout import topology_of
from megatronapp.parallel.ops import RankProgram
from megatronapp.trace.events import Event, RunResult
from megatronapp.trace.sections import FbdSection

from .hetero import iteration_periods, steady_iteration_s
from .ranks import FbdLayout
from .workers import worker_programs

Events = Mapping[int, Sequence[Event]]
PHASE_NAMES = {"F": "forward", "B": "backward"}


def fbd_settings(s: Scenario) -> Fbd:
    """The scenario's ``fbd`` section, or the defaults when it has none."""
    return s.fbd or Fbd()


def fbd_layout(s: Scenario) -> FbdLayout:
    return FbdLayout(topology_of(s), forward_tp=fbd_settings(s).forward_tp or s.parallel.tp,
                     backward_tp=s.parallel.tp)


def fbd_programs(s: Scenario, stage_for: Callable[[int], Any] | None = None
                 ) -> dict[int, RankProgram]:
    """worker id -> program of every forward and backward worker of ``s``
    (``stage_for``: virtual rank -> its ``DecoupledStage``)."""
    return worker_programs(fbd_layout(s), stage_costs(s), s.parallel.microbatches,
                           s.iterations, stage_for)


@dataclass(frozen=True)
class DeviceInfo:
    """What a backend knows about one physical device."""

    device_class: str
    memory_bytes: float  # capacity
    peak_memory_bytes: float  # modelled (sim) or measured (torch)


@dataclass
class FbdRunResult(RunResult):
    """A RunResult whose "ranks" are worker threads, each labelled with its device."""

    labels: dict[int, str] = field(default_factory=dict)

    def label(self, rank: int) -> str:
        return self.labels.get(rank, f"worker {rank}")


def worker_label(layout: FbdLayout, wid: int, device_class: str) -> str:
    worker = layout.worker(wid)
    c = layout.topo.coord(worker.vrank)
    device = layout.device_of(worker)
    return (f"{PHASE_NAMES[worker.phase]} worker {worker} · virtual rank {worker.vrank} "
            f"(dp {c.dp}, pp {c.pp}, tp {c.tp}) · device {device} [{device_class}]")


def worker_labels(layout: FbdLayout, classes: Sequence[str]) -> dict[int, str]:
    return {w: worker_label(layout, w, classes[layout.device_of(layout.worker(w))])
            for w in range(layout.num_workers)}


def gpt_stage_flops(s: Scenario) -> list[float]:
    """Forward FLOPs of one microbatch on one virtual rank, per pipeline stage
    (the scenario's GPT: its layers, plus the logits on the last stage)."""
    m, p = s.model, s.parallel
    logits = 2 * m.micro_batch_size * m.seq_len * m.hidden * m.vocab
    body = m.layers // p.pp * layer_forward_flops(s)
    return [(body + (logits if r == p.pp - 1 else 0)) / p.tp for r in range(p.pp)]


def useful_flops_by_worker(layout: FbdLayout, events: Events,
                           stage_flops: Sequence[float]) -> dict[int, float]:
    """Model FLOPs each worker did over the run, recomputation excluded: a
    forward is 1x its stage's forward FLOPs, a backward 2x. The last stage has
    no forward worker compute; its backward worker's recompute is the model's
    forward there."""
    pp = layout.topo.pp
    out: dict[int, float] = {}
    for wid, evs in events.items():
        worker = layout.worker(wid)
        stage_rank = layout.topo.coord(worker.vrank).pp
        last, stage = stage_rank == pp - 1, stage_flops[stage_rank]
        names = [e.name for e in evs]
        if worker.phase == "F":
            out[wid] = names.count("forward") * stage
        else:
            recomputed = names.count("recompute_forward") if last else 0
            out[wid] = (2 * names.count("backward") + recomputed) * stage
    return out


def _busy_s(events: Sequence[Event]) -> float:
    return sum(e.dur_s for e in events if e.name in COMPUTE_NAMES)


def device_rows(s: Scenario, layout: FbdLayout, devices: Sequence[DeviceInfo],
                events: Events, stage_flops: Sequence[float]) -> list[dict[str, Any]]:
    """Per device: role, class, workers, useful TFLOPS, busy share, peak memory."""
    period = steady_iteration_s(events)
    span = sum(iteration_periods(events))
    flops = useful_flops_by_worker(layout, events, stage_flops)
    rows = []
    for device, wids in layout.workers_by_device.items():
        info = devices[device]
        busy = sum(_busy_s(events.get(w, ())) for w in wids)
        per_iteration = sum(flops.get(w, 0.0) for w in wids) / s.iterations
        rows.append({
            "device": device, "role": PHASE_NAMES.get(layout.phase_of_device(device), "both"),
            "class": info.device_class, "workers": [str(layout.worker(w)) for w in wids],
            "useful_tflops": per_iteration / period / 1e12 if period > 0 else 0.0,
            "busy_fraction": min(1.0, busy / span) if span > 0 else 0.0,
            "peak_memory_bytes": info.peak_memory_bytes, "memory_bytes": info.memory_bytes,
            "fits": info.peak_memory_bytes <= info.memory_bytes})
    return rows


def fbd_section(s: Scenario, layout: FbdLayout, devices: Sequence[DeviceInfo], events: Events,
                stages: str, stage_flops: Sequence[float], **more: Any) -> FbdSection:
    """What a decoupled run adds to (and overrides in) summary.json.
    ``stages``: what ran ("analytic" GPT costs in simulation, "gpt" on torch)."""
    rows = device_rows(s, layout, devices, events, stage_flops)
    return FbdSection(
        world_size=layout.num_devices, iteration_times_s=iteration_periods(events),
        # FBD's bubble: the mean share of the run a device's compute sits idle
        bubble_fraction=1.0 - sum(r["busy_fraction"] for r in rows) / len(rows),
        stages=stages, virtual={"tp": s.parallel.tp, "pp": s.parallel.pp, "dp": s.parallel.dp},
        forward_tp=layout.forward_tp, steady_iteration_s=steady_iteration_s(events),
        useful_tflops_per_device=sum(r["useful_tflops"] for r in rows) / len(rows),
        devices=rows,
        device_of_worker={str(w): layout.device_of(layout.worker(w))
                          for w in range(layout.num_workers)}, more=more)


def worker_clocks(layout: FbdLayout, device_clocks: Mapping[int, Any]) -> dict[int, Any]:
    """Threads of one device share its clock."""
    return {w: device_clocks[layout.device_of(layout.worker(w))]
            for w in range(layout.num_workers)}



def summary_lines(summary: Mapping[str, Any]) -> list[str]:
    """The human summary of a decoupled run (``megatronapp run``)."""
    fbd, sc = summary["fbd"], summary["scenario"]
    v, times = fbd["virtual"], summary["iteration_times_s"]
    lines = [f"{sc['name']}: {summary['backend']} backend, MegaFBD on {summary['world_size']} "
             f"devices (virtual tp {v['tp']}, pp {v['pp']}, dp {v['dp']}; forward tp "
             f"{fbd['forward_tp']}), {sc['parallel']['microbatches']} microbatches, "
             f"{fbd['stages']} stages",
             f"  iterations: {len(times)}, steady {fbd['steady_iteration_s'] * 1e3:.3f} ms "
             f"(first {times[0] * 1e3:.3f} ms, with the pipeline fill)",
             f"  useful TFLOPS per device: {fbd['useful_tflops_per_device']:.4g}; "
             f"mean device idle fraction: {summary['bubble_fraction']:.3f}"]
    for d in fbd["devices"]:
        lines.append(f"  device {d['device']} {d['role']:<8} [{d['class']}] "
                     f"{' '.join(d['workers']):<8} {d['useful_tflops']:7.4g} TFLOPS, busy "
                     f"{d['busy_fraction']:.2f}, peak {d['peak_memory_bytes'] / 1e9:.2f} GB of "
                     f"{d['memory_bytes'] / 1e9:.0f}{'' if d['fits'] else ' (OOM)'}")
    return lines
