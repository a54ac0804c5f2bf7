"""Narayanan et al. 2021, Table 1: constants fitted on two rows (one without a
pipeline, one with) predict others within 5%, and strong scaling loses
throughput per GPU as the paper's does."""
from __future__ import annotations

import pytest

from sim import simulate_iteration_times
from megatronapp.scenario.config import Scenario, load_scenario
from megatronapp.fidelity.fit import fit_constants, with_settings
from megatronapp.fidelity.predict import predict
from megatronapp.fidelity.published import (NARAYANAN_TABLE1_TFLOPS, TABLE1_KNOBS,
                                            iteration_s_from_tflops)

from .support import ROOT


def row(i: int) -> Scenario:
    return load_scenario(ROOT / "scenarios" / "narayanan2021" / f"row{i:02d}.yaml")


def replica_time(s: Scenario) -> float:
    return simulate_iteration_times(s, replica=True)[0]


def tflops_per_gpu(s: Scenario) -> float:
    return predict(s, simulate_iteration_times, replica=True).hardware_tflops_per_gpu


@pytest.fixture(scope="module")
def fitted() -> dict[str, float]:
    targets = [(row(i), iteration_s_from_tflops(row(i), NARAYANAN_TABLE1_TFLOPS[i]))
               for i in (1, 7)]
    return fit_constants(targets, TABLE1_KNOBS, replica_time).values


@pytest.mark.slow
@pytest.mark.parametrize("i", [2, 3, 5])
def test_rows_not_fitted_on_are_predicted_within_5_percent(fitted: dict[str, float],
                                                           i: int) -> None:
    predicted = tflops_per_gpu(with_settings(row(i), fitted))
    assert predicted == pytest.approx(NARAYANAN_TABLE1_TFLOPS[i], rel=0.05)


@pytest.mark.slow
def test_strong_scaling_loses_throughput_per_gpu(fitted: dict[str, float]) -> None:
    """Fixed global batch on more replicas: fewer microbatches each, a larger
    pipeline bubble, so TFLOP/s per GPU falls (Narayanan et al. §5.2)."""
    s = row(5)
    batch = s.parallel.dp * s.parallel.microbatches
    series = [tflops_per_gpu(with_settings(s, {**fitted, "parallel.dp": dp,
                                               "parallel.microbatches": batch // dp}))
              for dp in (s.parallel.dp // 2, s.parallel.dp, s.parallel.dp * 2)]
    assert series[0] > series[1] > series[2]
