"""Narayanan et al. 2021, Table 1: constants fitted on two rows (one without a
pipeline, one with) predict others within 5%, and strong scaling loses
throughput per GPU as the paper's does."""
from __future__ import annotations

import pytest

from sim import simulate_iteration_times
from megatronapp.scenario.config import Scenario
from megatronapp.scenario.devices import DEVICES
from megatronapp.costs.flops import hardware_flops_per_iteration
from megatronapp.fidelity.fit import with_settings
from megatronapp.fidelity.predict import predict
from megatronapp.fidelity.published import (LEFT_OUT, NARAYANAN_TABLE1_TFLOPS, PublishedRun,
                                            fit_flops_only_efficiency, fit_simulator,
                                            flops_only_peak_share, held_out_errors,
                                            narayanan_row, published_runs)

from .support import ROOT


def row(i: int) -> Scenario:
    return narayanan_row(ROOT, i)


def replica_time(s: Scenario) -> float:
    return simulate_iteration_times(s, replica=True)[0]


def tflops_per_gpu(s: Scenario) -> float:
    return predict(s, simulate_iteration_times, replica=True).hardware_tflops_per_gpu


@pytest.fixture(scope="module")
def fitted() -> dict[str, float]:
    return fit_simulator([r for r in published_runs(ROOT) if r.fitted], replica_time).values


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


@pytest.mark.slow
def test_the_a100_profile_holds_the_constants_the_fit_finds(fitted: dict[str, float]) -> None:
    profile = DEVICES["a100-80gb"].fitted
    for key, value in fitted.items():
        assert profile[key.split(".")[-1]] == pytest.approx(value, rel=1e-3)


def test_every_published_row_is_fitted_or_held_out_and_few_are_fitted() -> None:
    runs = published_runs(ROOT)
    fitted_rows = [r for r in runs if r.fitted]
    assert len(fitted_rows) == 2 and len(runs) == len(NARAYANAN_TABLE1_TFLOPS)
    assert all(r.scenario.cluster.gpu.tflops == DEVICES["a100-80gb"].gpu["tflops"] for r in runs)
    assert all(left.missing for left in LEFT_OUT)


def test_the_flops_only_peer_does_not_see_the_parallel_layout() -> None:
    """6·N·tokens at one efficiency: the same model and global batch on another
    layout predicts the same throughput per GPU (no bubble, no communication)."""
    s = row(5)
    other = with_settings(s, {"parallel.pp": 1, "parallel.dp": s.parallel.dp * 2,
                              "parallel.microbatches": s.parallel.microbatches // 2})
    assert flops_only_peak_share(other) == pytest.approx(flops_only_peak_share(s), rel=1e-12)


def test_the_flops_only_peer_counts_8_flops_per_parameter_with_full_recompute() -> None:
    full = row(1)
    none = with_settings(full, {"training.recompute": "none"})
    # throughput is Eq. 3 FLOPs over the peer's time; the time scales as 8 : 6
    hw = [hardware_flops_per_iteration(x) for x in (full, none)]
    ratio = (flops_only_peak_share(full) / hw[0]) / (flops_only_peak_share(none) / hw[1])
    assert ratio == pytest.approx(6 / 8, rel=1e-12)


def test_the_flops_only_efficiency_is_recovered_from_exact_figures() -> None:
    runs = [PublishedRun(f"row {i}", row(i), flops_only_peak_share(row(i)) * 0.37, fitted=True)
            for i in (1, 4, 7)]
    assert fit_flops_only_efficiency(runs) == pytest.approx(0.37, rel=1e-12)


def test_the_worst_held_out_error_keeps_its_sign() -> None:
    assert held_out_errors([0.02, -0.3, 0.1]) == (pytest.approx(0.14), -0.3)
