"""Published measurements the simulator is checked against.

Narayanan et al. 2021 (SC21), Table 1: TFLOP/s per GPU of GPT models on up to
3072 A100 GPUs (peak 312), FLOPs counted with the paper's Eq. 3, recomputation
included. The rows' scenarios are ``scenarios/published/narayanan2021/rowNN.yaml``.

Every published row is either fitted (the efficiency constants are chosen on
it) or held out (predicted with those constants); rows whose configuration the
source does not give in full are listed with what is missing, not guessed.
Next to the simulator stands a FLOPs-only peer (what llm-analysis computes):
6·N·tokens FLOPs per iteration (8 with full recomputation) at one efficiency
of peak.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Callable, Sequence

from ..scenario.config import Scenario, load_scenario
from ..costs.flops import hardware_flops_per_iteration, microbatches_per_iteration
from .fit import FitResult, Knob, SimulateTime, fit_constants

NARAYANAN_TABLE1_TFLOPS: dict[int, float] = {
    1: 137, 2: 138, 3: 142, 4: 135, 5: 138, 6: 140, 7: 148, 8: 155, 9: 163, 10: 163}
# One row without a pipeline and one with, so the fit sees pipeline idle time.
NARAYANAN_FITTED_ROWS = (1, 7)

# The two constants fitted on two rows: the GEMMs' share of peak, and HBM
# bytes moved per stored activation byte (elementwise work).
TABLE1_KNOBS = (Knob("cluster.gpu.efficiency", 0.6, 0.05, 1.0),
                Knob("cluster.gpu.elementwise_traffic", 1.0, 0.0, 20.0))


@dataclass(frozen=True)
class PublishedRun:
    source: str  # paper, table, row
    scenario: Scenario
    tflops_per_gpu: float  # the published figure
    fitted: bool


@dataclass(frozen=True)
class LeftOut:
    source: str
    missing: str  # what the source does not give


# Rows the user-facing comparison names whose source is not available here in
# full, or does not give the whole configuration.
LEFT_OUT = (
    LeftOut("Jiang et al. 2024 (MegaScale), Table 2, Megatron-LM rows (175B, 256-12,288 GPUs)",
            "micro-batch size, recomputation, sequence parallelism, optimizer sharding and GPU "
            "model (only 'Ampere') are not given; Table 1 gives 96 layers, hidden 12288, "
            "128 heads, tp 8, pp 8, and §6.1 vpp 6, sequence 2048, vocabulary 64,000"),
    LeftOut("Korthikanti et al. 2022, Table 5 (22B-1T, A100)", "the paper is not available here"),
    LeftOut("Smith et al. 2022 (MT-NLG 530B, A100)", "the paper is not available here"),
    LeftOut("BigScience 2022 (BLOOM-176B, A100)", "the paper is not available here"),
    LeftOut("Megatron-LM README, H100 table (1.7B-462B)", "the table is not available here"),
    LeftOut("Llama 3 (Dubey et al. 2024), Table 4 (405B, H100)",
            "the paper is not available here; it also needs context parallelism"),
)


def narayanan_row(root: Path, i: int) -> Scenario:
    return load_scenario(root / "scenarios" / "published" / "narayanan2021" / f"row{i:02d}.yaml")


def published_runs(root: Path) -> list[PublishedRun]:
    """Every published row with its whole configuration, fitted rows marked."""
    return [PublishedRun(f"Narayanan et al. 2021, Table 1, row {i}", narayanan_row(root, i),
                         tflops, i in NARAYANAN_FITTED_ROWS)
            for i, tflops in NARAYANAN_TABLE1_TFLOPS.items()]


def iteration_s_from_tflops(s: Scenario, tflops_per_gpu: float) -> float:
    """A published throughput back to an iteration time (Eq. 3 FLOPs)."""
    return hardware_flops_per_iteration(s) / s.world_size / (tflops_per_gpu * 1e12)


def parameter_count(s: Scenario) -> float:
    """GPT parameters, Narayanan et al.'s count: 12·l·h²·(1 + 13/(12h)) + (V + s)·h."""
    m = s.model
    return (12 * m.layers * m.hidden ** 2 * (1 + 13 / (12 * m.hidden))
            + (m.vocab + m.seq_len) * m.hidden)


def flops_only_peak_share(s: Scenario) -> float:
    """TFLOP/s per GPU the FLOPs-only peer predicts, per unit of its efficiency:
    iteration time 6·N·tokens (8 with full recomputation) / (GPUs · peak · e),
    reported with the same Eq. 3 FLOPs as the published figure."""
    per_token = 8 if s.training.recompute == "full" else 6
    tokens = microbatches_per_iteration(s) * s.model.micro_batch_size * s.model.seq_len
    time_at_unit_efficiency = (per_token * parameter_count(s) * tokens
                               / (s.world_size * s.cluster.gpu.tflops * 1e12))
    return hardware_flops_per_iteration(s) / s.world_size / time_at_unit_efficiency / 1e12


def fit_flops_only_efficiency(runs: Sequence[PublishedRun]) -> float:
    """The peer's one efficiency, least squares on relative error over the fitted
    rows: predicted = c·e, so e = Σ(c/p) / Σ(c/p)²."""
    ratios = [flops_only_peak_share(r.scenario) / r.tflops_per_gpu for r in runs if r.fitted]
    return sum(ratios) / sum(q * q for q in ratios)


def held_out_errors(errors: Sequence[float]) -> tuple[float, float]:
    """Mean |error| and the worst error (signed) of held-out rows."""
    return fmean(abs(e) for e in errors), max(errors, key=abs)


def fit_simulator(runs: Sequence[PublishedRun], simulate: SimulateTime,
                  progress: Callable[[str], None] | None = None) -> FitResult:
    """The efficiency model's constants fitted on ``runs`` (their published
    throughputs as iteration times)."""
    targets = [(r.scenario, iteration_s_from_tflops(r.scenario, r.tflops_per_gpu)) for r in runs]
    return fit_constants(targets, TABLE1_KNOBS, simulate, progress=progress)
