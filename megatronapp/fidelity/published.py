"""Published measurements the simulator is checked against.

The rows are listed in ``scenarios/published/runs.yaml``: Narayanan et al.
2021 Table 1, Korthikanti et al. 2022 Table 5, MT-NLG 530B and BLOOM-176B (A100), the
Megatron-LM README's Megatron-Core table and Llama 3 405B (H100), each with its scenario file
(where every field comes from, and which are assumed, is written there), its
published figure and its role. Every row is either fitted (its device's
efficiency constants are chosen on it) or held out (predicted with those
constants); rows the simulator cannot express, or whose configuration the
source does not give, are listed with the reason, not guessed.
Next to the simulator stands a FLOPs-only peer (what llm-analysis computes):
6·N·tokens FLOPs per iteration (8 with full recomputation) at one efficiency
of peak, fitted per device on the same rows.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from statistics import fmean
from typing import Any, Callable, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict

from ..io import gate
from ..io.text import load_yaml
from ..scenario.config import Scenario, load_scenario
from ..scenario.devices import DEVICES
from ..scenario.software import DEFAULT_SOFTWARE
from ..costs.flops import (hardware_flops_per_iteration, microbatches_per_iteration,
                           model_flops_per_iteration)
from .fit import FitResult, Knob, Mapper, SimulateTime, fit_constants, with_settings
from .predict import Comparison

# The efficiency model's two constants: the GEMMs' share of peak, and HBM
# bytes moved per stored activation byte (elementwise work). On A100 both are
# fitted on one Table-1 row without a pipeline and one with, so the fit sees
# pipeline idle time.
TABLE1_KNOBS = (Knob("cluster.gpu.efficiency", 0.6, 0.05, 1.0),
                Knob("cluster.gpu.elementwise_traffic", 1.0, 0.0, 20.0))
EFFICIENCY_KNOB = TABLE1_KNOBS[0]
# H100 fits neither the elementwise traffic (its rows, one sequence length and
# fused attention, do not tell it from the efficiency: fitted together, the
# second Gauss-Newton step was 86% off) nor the GEMM size at half efficiency
# (megatronapp/costs/gemm.py; fitted with the efficiency, four steps left the
# worst row at 35%). Bytes moved per stored activation byte belong to the
# kernels, so the A100's value is kept (KEPT_FROM).
GEMM_HALF_KNOB = Knob("cluster.gpu.gemm_half_gflops", 10.0, 0.0, 1000.0)
# With its kernels measured (megatronapp/costs/kernels.py), an H100 generation fits
# only what they cannot give: how much slower a training step runs its kernels
# than they ran alone, and what Megatron-core's pipeline exchange costs per
# point-to-point operation beyond its bytes (costs/pipeline_step.py).
KERNEL_TIME_KNOB = Knob("cluster.gpu.kernel_time_factor", 1.1, 0.5, 3.0)
P2P_OP_KNOB = Knob("cluster.gpu.p2p_op_us", 200.0, 0.0, 5000.0)
Generation = tuple[str, str]  # (device, software)
A100_2021: Generation = ("a100-80gb", "megatron-lm-2021")
# The constants fitted per device and software generation, each on rows of its own
# source (scenarios/published/runs.yaml says which and why), in the order they are fitted.
GENERATION_KNOBS: dict[Generation, tuple[Knob, ...]] = {
    A100_2021: TABLE1_KNOBS,
    ("a100-80gb", "megatron-lm-2022"): (EFFICIENCY_KNOB,),
    ("a100-80gb", "megatron-deepspeed"): (EFFICIENCY_KNOB,),
    ("h100-sxm", "megatron-core-0.8"): (KERNEL_TIME_KNOB, P2P_OP_KNOB),
    ("h100-sxm", "llama3-2024"): (KERNEL_TIME_KNOB,),
}
# Constants a generation takes from another's fit: generation -> (generation, constant).
KEPT_FROM: dict[Generation, tuple[Generation, str]] = {
    g: (A100_2021, "elementwise_traffic") for g in GENERATION_KNOBS if g != A100_2021}
# Every constant some fit sets: a generation's rows are fitted with the others at
# the device profile's values (or the model's), not at another generation's.
FITTED_KEYS = ("efficiency", "elementwise_traffic", "kernel_time_factor", "p2p_op_us")

RUNS_FILE = Path("scenarios") / "published" / "runs.yaml"
Metric = Literal["tflops_per_gpu", "model_tflops_per_gpu", "iteration_s"]
METRIC_UNITS: dict[str, str] = {"tflops_per_gpu": "TFLOP/s per GPU (with recomputation)",
                                "model_tflops_per_gpu": "model TFLOP/s per GPU",
                                "iteration_s": "s per iteration"}


class _RunEntry(BaseModel):
    """One entry of ``scenarios/published/runs.yaml``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    source: str
    scenario: str  # relative to scenarios/published/
    device: str  # the device profile whose constants the row fits or checks
    published: dict[Metric, float]
    role: Literal["fitted", "held out"]
    disputed: str = ""  # why it disagrees with its own source's other rows, whatever the model


@dataclass(frozen=True)
class PublishedRun:
    source: str  # paper, table, row
    scenario: Scenario
    metric: Metric  # what the source publishes
    value: float  # the published figure
    fitted: bool
    device: str = "a100-80gb"
    disputed: str = ""

    @property
    def generation(self) -> Generation:
        return self.device, self.scenario.cluster.gpu.software or DEFAULT_SOFTWARE

    @property
    def iteration_s(self) -> float:
        """The published figure as seconds per iteration."""
        return published_iteration_s(self.scenario, self.metric, self.value)


@dataclass(frozen=True)
class LeftOut:
    source: str
    missing: str  # what the source does not give, or what the simulator cannot express


# Rows of the sources named in the comparison that are not in the table: their
# configuration is not given in full, or the simulator cannot express it yet.
LEFT_OUT = (
    LeftOut("Jiang et al. 2024 (MegaScale), Table 2, Megatron-LM rows (175B, 256-12,288 GPUs)",
            "micro-batch size, recomputation, sequence parallelism, optimizer sharding and GPU "
            "model (only 'Ampere') are not given; Table 1 gives 96 layers, hidden 12288, "
            "128 heads, tp 8, pp 8, and §6.1 vpp 6, sequence 2048, vocabulary 64,000; the "
            "3,072 and 12,288-GPU rows are predicted with those assumptions written out "
            "(scenarios/published/megascale2024/) by experiments/megascale_scaling.py"),
)


def published_iteration_s(s: Scenario, metric: Metric, value: float) -> float:
    """A published figure as seconds per iteration: throughputs divide the
    iteration's FLOPs (with recomputation, or the model's alone) by GPUs × rate."""
    if metric == "iteration_s":
        return value
    flops = (hardware_flops_per_iteration(s) if metric == "tflops_per_gpu"
             else model_flops_per_iteration(s))
    return flops / s.world_size / (value * 1e12)


def _entries(root: Path) -> list[_RunEntry]:
    path = root / RUNS_FILE
    return [_RunEntry.model_validate(e)
            for e in load_yaml(gate.read_text(path, "", gate.MAX_TEXT_BYTES), str(path))]


def published_runs(root: Path) -> list[PublishedRun]:
    """Every published row of ``scenarios/published/runs.yaml``, fitted rows marked."""
    return [_run_of(root, e) for e in _entries(root)]


def _run_of(root: Path, e: _RunEntry) -> PublishedRun:
    if len(e.published) != 1:
        raise ValueError(f"{e.source}: published holds one figure, got {sorted(e.published)}")
    if e.device not in DEVICES:
        raise ValueError(f"{e.source}: unknown device {e.device!r}")
    (metric, value), = e.published.items()
    s = load_scenario(root / RUNS_FILE.parent / e.scenario)
    return PublishedRun(e.source, s, metric, value, e.role == "fitted", e.device, e.disputed)


def published_row_for(path: Path) -> PublishedRun | None:
    """The published row whose scenario file is ``path``, where ``path`` lies under a
    ``scenarios/published/`` directory whose ``runs.yaml`` lists it; else None."""
    path = path.resolve()
    for parent in path.parents:
        if (parent / RUNS_FILE).is_file() and path.is_relative_to(parent / RUNS_FILE.parent):
            return next((r for r, e in zip(published_runs(parent), _entries(parent))
                         if (parent / RUNS_FILE.parent / e.scenario).resolve() == path), None)
    return None


def comparison(run: PublishedRun, overridden: bool) -> Comparison:
    return Comparison(run.source, f"{run.value:g} {METRIC_UNITS[run.metric]}", run.iteration_s,
                      "fitted" if run.fitted else "held out", overridden)


def over_memory_gb(s: Scenario) -> float | None:
    """The heaviest stage's peak (GB) where it exceeds the device, else None."""
    from ..dpp.static_memory import static_peaks

    peak = max(static_peaks(s).values()) / 1e9
    return peak if peak > s.cluster.gpu.memory_gb else None


def predicted_row_s(run: PublishedRun, simulate: SimulateTime) -> tuple[float, float | None]:
    """A row's simulated iteration time and, where Megatron's memory accounting puts
    it over its device (a run its source evidently fitted otherwise), its peak in
    GB: timed then with the memory check lifted, as a static schedule's time does
    not depend on it."""
    lifted = memory_lifted(run.scenario)
    s = with_settings(run.scenario, lifted) if lifted else run.scenario
    return simulate(s), over_memory_gb(run.scenario)


def memory_lifted(s: Scenario) -> dict[str, float]:
    """The setting that lifts the memory check from a row over its device (its time
    does not depend on it), or none."""
    from ..scenario.config import MAX_RATE

    return {} if over_memory_gb(s) is None else {"cluster.gpu.memory_gb": MAX_RATE}


def narayanan_row(root: Path, i: int) -> Scenario:
    return load_scenario(root / "scenarios" / "published" / "narayanan2021" / f"row{i:02d}.yaml")


def narayanan_table1_tflops(root: Path) -> dict[int, float]:
    """Table 1's published TFLOP/s per GPU by row number."""
    prefix = "Narayanan et al. 2021, Table 1, row "
    return {int(r.source[len(prefix):]): r.value for r in published_runs(root)
            if r.source.startswith(prefix)}


def parameter_count(s: Scenario) -> float:
    """GPT parameters, Narayanan et al.'s count: 12·l·h²·(1 + 13/(12h)) + (V + s)·h."""
    m = s.model
    return (12 * m.layers * m.hidden ** 2 * (1 + 13 / (12 * m.hidden))
            + (m.vocab + m.seq_len) * m.hidden)


def flops_only_iteration_s(s: Scenario, efficiency: float) -> float:
    """The FLOPs-only peer's iteration time: 6·N·tokens (8 with full
    recomputation) over every GPU at ``efficiency`` of peak."""
    per_token = 8 if s.training.recompute == "full" else 6
    tokens = microbatches_per_iteration(s) * s.model.micro_batch_size * s.model.seq_len
    return (per_token * parameter_count(s) * tokens
            / (s.world_size * s.cluster.gpu.tflops * 1e12 * efficiency))


def fit_flops_only_efficiency(runs: Sequence[PublishedRun]) -> float:
    """The peer's one efficiency, least squares on relative throughput error
    over the fitted rows: predicted throughput = e·c with c = published time /
    time at efficiency 1, so e = Σc / Σc²."""
    ratios = [r.iteration_s / flops_only_iteration_s(r.scenario, 1.0) for r in runs if r.fitted]
    return sum(ratios) / sum(q * q for q in ratios)


def throughput_error(published_s: float, predicted_s: float) -> float:
    """Predicted over published throughput, minus one (positive: optimistic)."""
    return published_s / predicted_s - 1


def held_out_errors(errors: Sequence[float]) -> tuple[float, float]:
    """Mean |error| and the worst error (signed) of held-out rows."""
    return fmean(abs(e) for e in errors), max(errors, key=abs)


def unfitted(s: Scenario, device: str) -> dict[str, Any]:
    """Settings that put every fitted constant of ``s`` back at its device
    profile's value (or the model's default), whichever generation it came from."""
    from ..scenario.config import Gpu

    profile = DEVICES[device].gpu
    return {f"cluster.gpu.{k}": profile.get(k, Gpu.model_fields[k].default) for k in FITTED_KEYS}


def fit_generation(runs: Sequence[PublishedRun], generation: Generation, simulate: SimulateTime,
                   fitted: Mapping[Generation, Mapping[str, float]],
                   progress: Callable[[str], None] | None = None,
                   knobs: Sequence[Knob] | None = None,
                   mapper: Mapper = map, steps: int = 6) -> tuple[dict[str, float], FitResult]:
    """A generation's constants fitted on its fitted rows: its knobs
    (``GENERATION_KNOBS`` unless given) fitted, with every other fitted constant
    at the device's own value and what it keeps from another generation's fit
    (``fitted``: by generation) set first."""
    kept: dict[str, float] = {}
    if generation in KEPT_FROM:
        other, name = KEPT_FROM[generation]
        kept[name] = fitted[other][name]
    rows = [PublishedRun(r.source, with_settings(r.scenario, {
                **unfitted(r.scenario, r.device), **memory_lifted(r.scenario),
                **{f"cluster.gpu.{k}": v for k, v in kept.items()}}),
                r.metric, r.value, r.fitted, r.device)
            for r in runs if r.fitted and r.generation == generation]
    own = fitted.get(generation, {})  # a refit starts where the last fit ended
    knobs = [replace(k, start=own.get(k.key.split(".")[-1], k.start))
             for k in (knobs or GENERATION_KNOBS[generation])]
    fit = fit_simulator(rows, simulate, progress, knobs, mapper, steps)
    return {**kept, **{k.split(".")[-1]: v for k, v in fit.values.items()}}, fit


def fit_simulator(runs: Sequence[PublishedRun], simulate: SimulateTime,
                  progress: Callable[[str], None] | None = None,
                  knobs: Sequence[Knob] = TABLE1_KNOBS, mapper: Mapper = map,
                  steps: int = 6) -> FitResult:
    """The efficiency model's constants (``knobs``) fitted on ``runs`` (their
    published figures as iteration times)."""
    targets = [(r.scenario, r.iteration_s) for r in runs]
    return fit_constants(targets, knobs, simulate, steps, progress=progress, mapper=mapper)
