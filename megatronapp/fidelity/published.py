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

from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Callable, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict

from ..io import gate
from ..io.text import load_yaml
from ..scenario.config import Scenario, load_scenario
from ..scenario.devices import DEVICES
from ..costs.flops import (hardware_flops_per_iteration, microbatches_per_iteration,
                           model_flops_per_iteration)
from .fit import FitResult, Knob, SimulateTime, fit_constants, with_settings

# The efficiency model's two constants: the GEMMs' share of peak, and HBM
# bytes moved per stored activation byte (elementwise work). On A100 both are
# fitted on one Table-1 row without a pipeline and one with, so the fit sees
# pipeline idle time.
TABLE1_KNOBS = (Knob("cluster.gpu.efficiency", 0.6, 0.05, 1.0),
                Knob("cluster.gpu.elementwise_traffic", 1.0, 0.0, 20.0))
# H100: the efficiency only. Its three fitted rows (one sequence length, fused
# attention, sequence parallelism) do not tell the efficiency and the
# elementwise traffic apart (fitted together from the A100 values, the second
# Gauss-Newton step was 86% off), nor the efficiency and the GEMM size at half
# of it (megatronapp/costs/gemm.py): fitted together, four steps left the
# rows' worst error at 35%, no better than the first. Bytes moved per stored
# activation byte belong to the kernels, so the A100 value is kept
# (KEPT_FROM); the size constant stays 0 (waves and the roofline only).
GEMM_HALF_KNOB = Knob("cluster.gpu.gemm_half_gflops", 10.0, 0.0, 1000.0)
# Since its kernels were measured (megatronapp/costs/kernels.py), H100 fits only
# what they cannot give: how much slower a training step runs its kernels than
# the kernels ran alone (one factor over every measured kernel).
KERNEL_TIME_KNOB = Knob("cluster.gpu.kernel_time_factor", 1.1, 0.5, 3.0)
DEVICE_KNOBS: dict[str, tuple[Knob, ...]] = {"a100-80gb": TABLE1_KNOBS,
                                             "h100-sxm": (KERNEL_TIME_KNOB,)}
# Constants a device takes from another device's fit: (device, constant).
KEPT_FROM: dict[str, tuple[str, str]] = {"h100-sxm": ("a100-80gb", "elementwise_traffic")}

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


@dataclass(frozen=True)
class PublishedRun:
    source: str  # paper, table, row
    scenario: Scenario
    metric: Metric  # what the source publishes
    value: float  # the published figure
    fitted: bool
    device: str = "a100-80gb"

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
            "(scenarios/published/megascale2024/) by paper_figs/megascale_scaling.py"),
)


def published_iteration_s(s: Scenario, metric: Metric, value: float) -> float:
    """A published figure as seconds per iteration: throughputs divide the
    iteration's FLOPs (with recomputation, or the model's alone) by GPUs × rate."""
    if metric == "iteration_s":
        return value
    flops = (hardware_flops_per_iteration(s) if metric == "tflops_per_gpu"
             else model_flops_per_iteration(s))
    return flops / s.world_size / (value * 1e12)


def published_runs(root: Path) -> list[PublishedRun]:
    """Every published row of ``scenarios/published/runs.yaml``, fitted rows marked."""
    path = root / RUNS_FILE
    entries = [_RunEntry.model_validate(e)
               for e in load_yaml(gate.read_text(path, "", gate.MAX_TEXT_BYTES), str(path))]
    return [_run_of(root, e) for e in entries]


def _run_of(root: Path, e: _RunEntry) -> PublishedRun:
    if len(e.published) != 1:
        raise ValueError(f"{e.source}: published holds one figure, got {sorted(e.published)}")
    if e.device not in DEVICES:
        raise ValueError(f"{e.source}: unknown device {e.device!r}")
    (metric, value), = e.published.items()
    s = load_scenario(root / RUNS_FILE.parent / e.scenario)
    return PublishedRun(e.source, s, metric, value, e.role == "fitted", e.device)


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


def fit_device(runs: Sequence[PublishedRun], device: str, simulate: SimulateTime,
               fitted: Mapping[str, Mapping[str, float]],
               progress: Callable[[str], None] | None = None,
               knobs: Sequence[Knob] | None = None) -> tuple[dict[str, float], FitResult]:
    """A device's constants fitted on its fitted rows: its knobs (``DEVICE_KNOBS``
    unless given) fitted, what it keeps from another device's constants
    (``fitted``: by device) set first."""
    kept: dict[str, float] = {}
    if device in KEPT_FROM:
        other, name = KEPT_FROM[device]
        kept[name] = fitted[other][name]
    settings = {f"cluster.gpu.{k}": v for k, v in kept.items()}
    rows = [PublishedRun(r.source, with_settings(r.scenario, settings), r.metric, r.value,
                         r.fitted, r.device) for r in runs if r.fitted and r.device == device]
    fit = fit_simulator(rows, simulate, progress, knobs or DEVICE_KNOBS[device])
    return {**kept, **{k.split(".")[-1]: v for k, v in fit.values.items()}}, fit


def fit_simulator(runs: Sequence[PublishedRun], simulate: SimulateTime,
                  progress: Callable[[str], None] | None = None,
                  knobs: Sequence[Knob] = TABLE1_KNOBS) -> FitResult:
    """The efficiency model's constants (``knobs``) fitted on ``runs`` (their
    published figures as iteration times)."""
    targets = [(r.scenario, r.iteration_s) for r in runs]
    return fit_constants(targets, knobs, simulate, progress=progress)
