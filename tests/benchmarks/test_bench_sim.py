"""Simulator speed (pytest-benchmark): run with --benchmark-enable -p no:xdist.

The ratio to a bare SimPy loop is measured in the same test, so machine noise
affects both sides alike; it is reported in extra_info, not asserted.
"""
import pytest

from megatronapp.scenario.config import parse_scenario
from tests.benchmarks.speed import JOB_1024, job_1024, simulate_speed
from sim import run_sim
from sim import bare_simpy_events_per_s


def test_simulated_ops_per_second_vs_bare_simpy(benchmark) -> None:
    s = parse_scenario({**JOB_1024, "parallel": {"tp": 2, "pp": 4, "dp": 8, "microbatches": 16}})
    speed = benchmark.pedantic(simulate_speed, args=(s, run_sim), rounds=3, iterations=1)
    bare = bare_simpy_events_per_s()
    benchmark.extra_info.update(ops=speed.ops, ops_per_s=speed.ops_per_s, bare_per_s=bare,
                                ratio=speed.ops_per_s / bare)
    assert speed.ops > 0


@pytest.mark.slow
def test_one_iteration_of_1024_gpu_job(benchmark) -> None:
    speed = benchmark.pedantic(simulate_speed, args=(job_1024(), run_sim), rounds=1, iterations=1)
    benchmark.extra_info.update(ops=speed.ops, wall_s=speed.wall_s)
    # 1024 ranks x (32 forward + 32 backward + their p2p and TP collectives)
    assert speed.ops > 1024 * 64
