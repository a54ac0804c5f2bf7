"""Predict a scenario's iteration time, throughput and memory per rank.

The simulation itself is handed in (``IterationTimes``: a backend's function
from a scenario to its simulated iteration times), so this module knows no
backend. Throughput is reported two ways: model FLOPs utilisation (forward and
backward FLOPs the model needs, over peak) and hardware TFLOP/s per GPU
(recomputation included: Narayanan et al.'s Eq. 3 with full recomputation).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from statistics import fmean
from typing import Any, Callable, Sequence

from ..scenario.config import Scenario, adjustments
from ..scenario.devices import fit_note
from ..errors import UserError
from ..costs.flops import hardware_flops_per_iteration, model_flops_per_iteration
from ..dpp.static_memory import stage_memory
from ..costs.memory import RankMemory

# scenario, replica -> simulated iteration times in seconds
IterationTimes = Callable[[Scenario, bool], list[float]]


def steady_state_s(times: Sequence[float]) -> float:
    """Steady state: the mean after the first iteration when there are several
    (the first has no previous step's overlapped weight gather to wait for)."""
    return fmean(times[1:] if len(times) > 1 else times)


@dataclass(frozen=True)
class Comparison:
    """A published row's figure beside the prediction of its scenario."""

    source: str
    figure: str  # as the source gives it, e.g. "408.8 model TFLOP/s per GPU"
    published_s: float  # the figure as seconds per iteration
    role: str  # fitted | held out
    overridden: bool  # --set changed the scenario the figure belongs to

    def error(self, predicted_s: float) -> float:
        """Predicted over published throughput, minus one (positive: optimistic)."""
        return self.published_s / predicted_s - 1


@dataclass(frozen=True)
class Prediction:
    name: str
    gpus: int
    peak_flops_per_gpu: float
    iteration_times_s: tuple[float, ...]
    model_flops: float  # per iteration, all GPUs
    hardware_flops: float
    memory: tuple[RankMemory, ...]  # one rank of each pipeline stage
    capacity_bytes: float
    notes: tuple[str, ...]
    replica: bool
    defaults: tuple[str, ...] = ()  # Megatron defaults the scenario left unset, as used
    published: Comparison | None = field(default=None)

    @property
    def iteration_s(self) -> float:
        return steady_state_s(self.iteration_times_s)

    @property
    def hardware_tflops_per_gpu(self) -> float:
        return self.hardware_flops / self.gpus / self.iteration_s / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / self.gpus / self.iteration_s / self.peak_flops_per_gpu

    @property
    def peak_memory_bytes(self) -> float | None:
        """None where the schedule decides its order at run time (adaptive):
        there is no static order to size the activations of."""
        return max((m.total for m in self.memory), default=None)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "gpus": self.gpus, "iteration_s": self.iteration_s,
                "iteration_times_s": list(self.iteration_times_s),
                "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu, "mfu": self.mfu,
                "model_flops_per_iteration": self.model_flops,
                "hardware_flops_per_iteration": self.hardware_flops,
                "memory_per_rank": [m.as_dict() for m in self.memory],
                "memory_capacity_bytes": self.capacity_bytes,
                "peak_memory_bytes": self.peak_memory_bytes,
                "notes": list(self.notes), "method": "replica" if self.replica else "full",
                "defaults_used": list(self.defaults), "published": self._published_dict()}

    def _published_dict(self) -> dict[str, Any] | None:
        c = self.published
        if c is None:
            return None
        return {"source": c.source, "figure": c.figure, "iteration_s": c.published_s,
                "role": c.role, "overridden": c.overridden,
                "error": c.error(self.iteration_s)}


def check_replica(s: Scenario) -> None:
    """One replica stands for all only when nothing makes replicas differ."""
    jitter = s.cluster.jitter
    if s.faults or jitter.compute_sigma > 0 or jitter.link_sigma > 0:
        raise UserError("--replica: the scenario has faults or jitter, so data-parallel "
                        "replicas differ; simulate it in full")


def steady_state_caveats(s: Scenario) -> list[str]:
    """What a one-iteration simulation leaves out of a long job's iterations."""
    t = s.training
    if (s.iterations == 1 and t.distributed_optimizer and t.overlap_param_gather
            and s.parallel.dp > 1):
        return ["training.overlap_param_gather: each step's weight all-gather runs under "
                "the next iteration's forward, which one simulated iteration does not "
                "have; set iterations: 2 for the steady state"]
    return []


def fit_notes(s: Scenario) -> list[str]:
    note = fit_note(s.cluster.gpu.device, s.cluster.gpu.software)
    return [note] if note else []


def predict(s: Scenario, iteration_times: IterationTimes, replica: bool = False) -> Prediction:
    """Simulate ``s`` (memory is checked first: a job that does not fit fails)."""
    if replica:
        check_replica(s)
    memory = tuple(stage_memory(s).values()) if s.schedule != "adaptive" else ()
    times = iteration_times(s, replica)
    return Prediction(
        name=s.name, gpus=s.world_size, peak_flops_per_gpu=s.cluster.gpu.tflops * 1e12,
        iteration_times_s=tuple(times), model_flops=model_flops_per_iteration(s),
        hardware_flops=hardware_flops_per_iteration(s), memory=memory,
        capacity_bytes=s.cluster.gpu.memory_gb * 1e9,
        notes=tuple(adjustments(s) + steady_state_caveats(s) + fit_notes(s)),
        replica=replica)


def _figure(value: float) -> str:
    """One decimal where that shows the value (111.9), else three significant
    digits (a CPU-sized model's 0.00042 TFLOP/s is not 0.0)."""
    return f"{value:.1f}" if value >= 1 or value == 0 else f"{value:.3g}"


def prediction_lines(p: Prediction) -> list[str]:
    """The human-readable report of ``megatronapp predict``."""
    lines = [f"{p.name}: {p.gpus} GPUs, predicted by simulating "
             f"{'one data-parallel replica' if p.replica else 'every rank'}"]
    lines += [f"  note: {n}" for n in p.notes]
    seconds = f"{p.iteration_s:.4f}" if p.iteration_s >= 0.01 else f"{p.iteration_s:.3g}"
    lines.append(f"  iteration time: {seconds} s "
                 f"({len(p.iteration_times_s)} iteration(s) simulated)")
    lines.append(f"  throughput: {_figure(p.hardware_tflops_per_gpu)} TFLOP/s per GPU "
                 f"(recomputation included), MFU {_figure(p.mfu * 100)}%")
    lines += published_lines(p)
    if not p.memory:
        lines.append("  memory per rank: not predicted (the schedule orders its work at run time)")
    else:
        lines.append(f"  memory per rank (GB; device {p.capacity_bytes / 1e9:.1f}):")
        lines.append("    stage  weights  grads  optimizer  activations  transient  buffers   total")
        for m in p.memory:
            lines.append(f"    {m.pp_rank:>5} {m.weights / 1e9:>8.2f} {m.grads / 1e9:>6.2f} "
                         f"{m.optimizer / 1e9:>10.2f} {m.activations / 1e9:>12.2f} "
                         f"{m.transient / 1e9:>10.2f} {m.buffers / 1e9:>8.2f} "
                         f"{m.total / 1e9:>7.2f}")
    if p.defaults:
        lines.append("  Megatron defaults used (keys the scenario leaves unset):")
        lines += [f"    {d}" for d in p.defaults]
    return lines


def published_lines(p: Prediction) -> list[str]:
    """The published figure of the row the scenario belongs to, and the error."""
    c = p.published
    if c is None:
        return []
    changed = " (the scenario changed by --set: not the published run)" if c.overridden else ""
    return [f"  published: {c.figure} = {c.published_s:.4f} s per iteration ({c.source}, "
            f"{c.role}){changed}",
            f"  error: {c.error(p.iteration_s) * 100:+.1f}% (predicted over published "
            "throughput, minus one: positive is optimistic)"]
