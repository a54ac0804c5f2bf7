"""A job simulated in parts (``sim.partition``): replicas split between
workers, the data-parallel collectives joined, gives the whole job's times
bit for bit; in this process and on a local Ray cluster."""
from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatronapp.scenario.config import parse_scenario
from sim.cluster import build_cluster
from sim.kernel_run import kernel_prices
from sim.partition import on_ray, replica_ranges, run_in_parts
from sim.run import run_sim

from megatronapp.program.compiled import CompiledRun
from megatronapp.scenario.config import Scenario

from .test_sim_kernel import _assert_same
from .test_sim_scale import jobs
from .test_sweep import ray_head  # noqa: F401 (a fixture)

OVERLAPPED = {"seed": 5, "iterations": 2, "schedule": "interleaved",
              "parallel": {"tp": 2, "pp": 2, "dp": 4, "vpp": 2, "microbatches": 4},
              "model": {"layers": 8, "hidden": 128, "heads": 4, "seq_len": 64, "vocab": 256},
              "cluster": {"gpus_per_node": 2,
                          "jitter": {"compute_sigma": 0.05, "link_sigma": 0.1}},
              "training": {"overlap_grad_reduce": True, "distributed_optimizer": True,
                           "overlap_param_gather": True, "bucket_params": 100000},
              "faults": [{"kind": "throttle", "rank": 5, "factor": 2.0}]}


def _whole(s: Scenario) -> CompiledRun:
    run = run_sim(s, reduce=False).source
    assert isinstance(run, CompiledRun)
    return run


def test_replicas_are_split_whole_and_evenly() -> None:
    assert replica_ranges(5, 2) == [(0, 2), (2, 5)]
    assert replica_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError):
        replica_ranges(2, 3)


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_overlapped_gradient_reduction_in_parts_is_the_whole_job(parts: int) -> None:
    """Buckets posted asynchronously, parameter gathers, two iterations: the
    parts wait for each other at every data-parallel collective."""
    s = parse_scenario(OVERLAPPED)
    _assert_same(_whole(s), run_in_parts(s, parts))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=jobs(overlap=True), split=st.integers(2, 4))
def test_random_jobs_in_parts_are_the_whole_job(data: dict[str, Any], split: int) -> None:
    s = parse_scenario(data)
    if s.parallel.dp < 2 or not kernel_prices(build_cluster(s)):
        return
    _assert_same(_whole(s), run_in_parts(s, min(split, s.parallel.dp)))


@pytest.mark.slow
def test_parts_on_a_local_ray_cluster_give_the_whole_job(
        ray_head: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    import ray

    address, env, _temp = ray_head
    monkeypatch.setenv("RAY_AUTH_MODE", env["RAY_AUTH_MODE"])
    s = parse_scenario(OVERLAPPED)
    start, gather = on_ray(address)
    try:
        handles: list[Any] = []

        def started(data: dict[str, Any], first: int, last: int) -> Any:
            handles.append(start(data, first, last))
            return handles[-1]

        in_parts = run_in_parts(s, 2, started, gather)
        workers = gather([h.call("process") for h in handles])
    finally:
        ray.shutdown()
    assert len(set(workers)) == 2 and os.getpid() not in workers  # two Ray workers ran them
    _assert_same(_whole(s), in_parts)
