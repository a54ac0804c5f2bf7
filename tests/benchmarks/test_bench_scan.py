"""Speed of MegaScan's pipeline on a 64-rank trace (measure with --benchmark-enable).

The 1024-rank figure comes from experiments/scan_bench_1024.py.
"""
from __future__ import annotations

import pytest

from megatronapp.scenario.config import parse_scenario
from megatronapp.scan.evidence.critical import critical_path
from megatronapp.scan.evidence.detect import megascan
from megatronapp.scan.eval.validate import scan_of_result
from sim import run_sim


@pytest.fixture(scope="module")
def result_64():
    return run_sim(parse_scenario({
        "seed": 1, "iterations": 1, "parallel": {"tp": 4, "pp": 4, "dp": 4, "microbatches": 8},
        "model": {"layers": 8, "hidden": 1024, "heads": 16, "seq_len": 1024},
        "cluster": {"jitter": {"compute_sigma": 0.02, "link_sigma": 0.05}},
        "faults": [{"kind": "throttle", "rank": 21, "factor": 1.5},
                   {"kind": "clock_skew", "rank": 40, "offset_us": 5000, "drift_ppm": 50}]}))


def test_bench_align_64_ranks(benchmark, result_64):
    scan = benchmark(scan_of_result, result_64)
    assert len(scan.clocks) == 64


def test_bench_critical_path_64_ranks(benchmark, result_64):
    scan = scan_of_result(result_64)
    path = benchmark(critical_path, scan.events, scan.ops)
    assert path.length_s > 0.99 * path.window_s  # aligned clocks: all but rounding explained


def test_bench_detect_64_ranks(benchmark, result_64):
    scan = scan_of_result(result_64)
    diagnosis = benchmark(megascan, scan)
    assert [c.rank for c in diagnosis.root_causes] == [21]
