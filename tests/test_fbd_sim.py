"""Decoupled workers on the simulated (heterogeneous) cluster."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from megatronapp.scenario.config import ScenarioError, parse_scenario
from megatronapp.costs.per_op import stage_costs
from megatronapp.fbd.hetero import steady_iteration_s, peak_outstanding
from sim.fbd import colocated_scenario, compare_plans, run_fbd

BASE = {"iterations": 2, "parallel": {"tp": 2, "pp": 2, "dp": 2, "microbatches": 6},
        "model": {"layers": 4, "hidden": 2048, "heads": 16, "seq_len": 1024, "vocab": 1000},
        "cluster": {"device_classes": [{"name": "fast", "count": 8, "tflops": 400,
                                        "memory_gb": 80},
                                       {"name": "slow", "count": 8, "tflops": 100,
                                        "memory_gb": 16}]},
        "fbd": {"forward_tp": 1, "forward_class": "slow", "backward_class": "fast"}}


def scenario(**fbd):
    return parse_scenario({**BASE, "fbd": {**BASE["fbd"], **fbd}})


@pytest.mark.parametrize("forward_tp", [1, 2])
def test_every_worker_runs_its_program_to_the_end(forward_tp):
    s = scenario(forward_tp=forward_tp)
    run = run_fbd(s)
    m, its = s.parallel.microbatches, s.iterations
    for wid, events in run.events.items():
        worker = run.layout.worker(wid)
        names = [e.name for e in events]
        if worker.phase == "B":
            assert names.count("recompute_forward") == names.count("backward") == m * its
            assert names.count("optimizer") == its
        elif run.layout.topo.coord(worker.vrank).pp < s.parallel.pp - 1:
            assert names.count("forward") == m * its
    assert run.rounds > 0  # the DP all-reduce crosses devices


def test_collectives_through_the_coordinator_end_together():
    run = run_fbd(scenario())
    ends: dict[tuple, set[float]] = {}
    for events in run.events.values():
        for e in events:
            if e.name == "dp_allreduce":
                ends.setdefault((tuple(e.args["group"]), e.args["iteration"]), set()).add(e.end_s)
    assert ends and all(len(v) == 1 for v in ends.values())


def test_packing_forward_shards_removes_forward_tp_collectives():
    packed, spread = run_fbd(scenario(forward_tp=1)), run_fbd(scenario(forward_tp=2))
    n = packed.layout.virtual_ranks

    def forward_tp_events(run):
        return [e for w in range(n) for e in run.events[w] if e.name == "tp_allreduce"]

    assert not forward_tp_events(packed) and forward_tp_events(spread)


def test_a_forward_bound_job_slows_with_its_forward_class():
    times = []
    for tflops in (400, 100, 25):
        data = {**BASE, "cluster": {"device_classes": [
            BASE["cluster"]["device_classes"][0],
            {"name": "slow", "count": 8, "tflops": tflops, "memory_gb": 16}]}}
        times.append(steady_iteration_s(run_fbd(parse_scenario(data)).events))
    # At 25 TFLOPS the forward instance is the bottleneck; between 400 and 100
    # the backward instance bounds the step (alignment rounds shift it a little).
    assert max(times[:2]) < times[2]


def test_comparison_plans_share_the_global_batch_and_fbd_saves_backward_memory():
    s = scenario()
    plans = compare_plans(s)
    assert len({p.useful_flops for p in plans}) == 1
    colocated, fbd = plans[0], plans[2]
    costs = stage_costs(s)
    # A backward device holds one recomputed microbatch, a co-located first
    # stage holds pp of them under 1F1B.
    assert fbd.peak_by_class()["fast"] < colocated.peak_by_class()["fast"]
    assert max(d.peak_memory_bytes for d in fbd.devices if d.role == "F") < costs.model_mem_bytes


def test_colocated_baseline_widens_data_parallelism_over_all_devices():
    s = scenario()
    base = colocated_scenario(s, 12)
    assert (base.parallel.dp, base.parallel.microbatches) == (3, 4)  # 12 = 2 x 6 microbatches
    with pytest.raises(ScenarioError, match="parallel"):
        colocated_scenario(s, 10)


def test_too_few_devices_in_a_class_is_a_scenario_error():
    data = {**BASE, "cluster": {"device_classes": [{"name": "fast", "count": 2, "tflops": 400,
                                                    "memory_gb": 80},
                                                   {"name": "slow", "count": 8, "tflops": 100,
                                                    "memory_gb": 16}]}}
    with pytest.raises(ScenarioError, match="cluster.device_classes"):
        run_fbd(parse_scenario(data))


@pytest.mark.parametrize("fbd, field", [({"forward_class": "gpu"}, "fbd.forward_class"),
                                        ({"forward_tp": 3}, "fbd.forward_tp"),
                                        ({"placement": 1}, "fbd.placement")])
def test_bad_fbd_keys_name_the_field(fbd, field):
    with pytest.raises(ScenarioError) as err:
        parse_scenario({**BASE, "fbd": fbd})
    assert err.value.field == field


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), max_size=12))
def test_peak_outstanding_matches_a_brute_force_count(intervals):
    intervals = [(a, a + b) for a, b in intervals]
    ups, downs = [a for a, _ in intervals], [b for _, b in intervals]
    brute = max([sum(1 for a, b in intervals if a <= t < b) for t in range(45)], default=0)
    assert peak_outstanding(ups, downs) == brute
