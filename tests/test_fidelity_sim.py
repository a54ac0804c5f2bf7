"""The simulator's Megatron options: TP collectives as operations, their ring
costs, data-parallel overlap, the distributed optimizer, one-replica
simulation, and the cost model with every option off."""
from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import pytest

from megatronapp.scenario.config import Scenario, parse_scenario
from megatronapp.costs.per_op import stage_costs
from megatronapp.parallel.ops import AllGather, AllReduce, ReduceScatter
from megatronapp.scan.evidence.detect import megascan
from megatronapp.scan.eval.validate import scan_of_result
from megatronapp.trace.summary import summarize
from megatronapp.trace.events import Event
from sim import run_sim, simulate_iteration_times
from sim.cluster import build_cluster
from sim.interpreter import SimInterpreter
from sim.network import gbps_to_bytes_per_s

TINY = {"layers": 4, "hidden": 256, "heads": 4, "seq_len": 128, "vocab": 1024}


def scenario(parallel: dict[str, Any], training: dict[str, Any] | None = None,
             **top: Any) -> Scenario:
    return parse_scenario({"parallel": {"microbatches": 4, **parallel}, "model": TINY,
                           "training": training or {}, **top})


def task_events(events: list[Event], it: int = 0, mb: int = 0, chunk: int = 0) -> list[Event]:
    return [e for e in events if e.args.get("iteration") == it
            and e.args.get("microbatch") == mb and e.args.get("chunk") == chunk]


# ------------------------------------------------------ ring collectives
@pytest.mark.parametrize("op,steps", [(AllReduce, 2), (ReduceScatter, 1), (AllGather, 1)])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_collective_costs(op: type, steps: int, n: int) -> None:
    s = parse_scenario({"parallel": {"dp": n}, "cluster": {"links": {
        "intra_node_gbps": 1000, "latency_us": 3}}})
    group, nbytes = tuple(range(n)), 6 * 10**7

    def program(rank: int):
        yield op(group=group, nbytes=nbytes)

    events = SimInterpreter(build_cluster(s)).run({r: program(r) for r in range(n)})
    expected = steps * ((n - 1) / n * nbytes / gbps_to_bytes_per_s(1000) + (n - 1) * 3e-6)
    assert events[0][0].dur_s == pytest.approx(expected, rel=1e-12)


def test_a_group_spanning_nodes_drives_one_nic_per_member_on_each_node() -> None:
    links = {"intra_node_gbps": 2400, "inter_node_gbps": 200, "latency_us": 0}
    data = {"parallel": {"dp": 8}, "cluster": {"gpus_per_node": 4, "links": links}}
    one = build_cluster(parse_scenario(data)).network
    many = build_cluster(parse_scenario({**data, "cluster": {
        "gpus_per_node": 4, "links": {**links, "nics_per_node": 4}}})).network
    group = tuple(range(8))  # 4 per node: NCCL's 4 rings use 4 NICs at once
    assert one.ring_collective_s("all_reduce", group, 10**9) == pytest.approx(
        4 * many.ring_collective_s("all_reduce", group, 10**9), rel=1e-12)


# ----------------------------------------------- TP collectives as ops
def layer_sequence(s: Scenario) -> list[str]:
    events = run_sim(s).events[0]
    return [e.name for e in task_events(events)]


def test_each_layer_all_reduces_after_its_attention_and_mlp_blocks() -> None:
    names = layer_sequence(scenario({"tp": 2, "pp": 2}))
    layer = ["forward", "tp_allreduce", "forward", "tp_allreduce"]
    assert names[:8] == layer * 2  # 2 layers per stage
    backward = [n for n in names[8:] if n not in ("send_forward", "recv_backward")]
    assert Counter(backward) == {"backward": 4, "tp_allreduce": 4}


def test_sequence_parallel_gathers_before_and_scatters_after_each_block() -> None:
    names = layer_sequence(scenario({"tp": 2, "pp": 2, "sequence_parallel": True}))
    block = ["tp_all_gather", "forward", "tp_reduce_scatter"]
    assert names[:12] == block * 4


def test_full_recomputation_repeats_each_layers_forward_collectives() -> None:
    plain = Counter(layer_sequence(scenario({"tp": 2, "pp": 2})))
    full = Counter(layer_sequence(scenario({"tp": 2, "pp": 2}, {"recompute": "full"})))
    assert full["tp_allreduce"] == plain["tp_allreduce"] + 4
    assert full["recompute_forward"] == 4 and plain["recompute_forward"] == 0


def test_megatron_stages_that_run_their_own_tp_comm_get_no_tp_ops() -> None:
    from megatronapp.run.jobs import rank_programs
    from megatronapp.program.ranks import NullStages

    class OwnComm(NullStages):
        does_tp_comm = True

    s = scenario({"tp": 2, "pp": 2})
    events = SimInterpreter(build_cluster(s)).run(rank_programs(s, lambda r: OwnComm()))
    assert not [e for e in events[0] if e.name.startswith("tp_")]
    assert Counter(e.name for e in task_events(events[0]))["forward"] == 1


def _tp_wait(s: Scenario, rank: int) -> float:
    return sum(e.dur_s for e in run_sim(s).events[rank] if e.name.startswith("tp_"))


def test_a_tp_straggler_makes_its_peer_wait_and_megascan_names_it() -> None:
    data = {"seed": 3, "parallel": {"tp": 2, "pp": 2, "dp": 2, "microbatches": 4},
            "model": {**TINY, "hidden": 4096, "heads": 32, "seq_len": 1024}, "iterations": 2,
            "cluster": {"jitter": {"compute_sigma": 0.02, "link_sigma": 0.05}}}
    healthy = parse_scenario(data)
    slow = parse_scenario({**data, "faults": [{"kind": "throttle", "rank": 1, "factor": 1.3}]})
    assert _tp_wait(slow, 0) > 1.5 * _tp_wait(healthy, 0)  # rank 0 waits in every layer
    diagnosis = megascan(scan_of_result(run_sim(slow)))
    assert [c.rank for c in diagnosis.root_causes] == [1]


def test_a_throttled_nvlink_slows_only_that_pairs_tp_collectives() -> None:
    no_latency = {"links": {"latency_us": 0}}
    base = scenario({"tp": 2, "pp": 2}, cluster=no_latency)
    slow = scenario({"tp": 2, "pp": 2}, cluster=no_latency,
                    faults=[{"kind": "slow_link", "ranks": [0, 1], "factor": 3.0}])
    assert _tp_wait(slow, 0) == pytest.approx(3 * _tp_wait(base, 0), rel=1e-9)
    assert _tp_wait(slow, 2) == pytest.approx(_tp_wait(base, 2), rel=1e-12)


# ------------------------------------------------------ data parallelism
BIG_GRADS = {"layers": 8, "hidden": 1024, "heads": 8, "seq_len": 256, "vocab": 1024}
SLOW_NICS = {"gpus_per_node": 2, "links": {"inter_node_gbps": 50}}


def dp_scenario(training: dict[str, Any], **parallel: Any) -> Scenario:
    return parse_scenario({"iterations": 2, "parallel": {"pp": 2, "dp": 2, "microbatches": 4,
                                                         **parallel},
                           "model": BIG_GRADS, "training": training, "cluster": SLOW_NICS})


def test_overlapped_gradient_buckets_hide_reduction_behind_backward() -> None:
    plain = dp_scenario({})
    overlapped = dp_scenario({"overlap_grad_reduce": True, "bucket_params": 2_000_000})
    events = run_sim(overlapped).events[0]
    buckets = [e for e in events if e.name == "dp_grad_bucket" and e.args["iteration"] == 0]
    last_backward_end = max(e.end_s for e in events if e.name == "backward"
                            and e.args["iteration"] == 0)
    assert len(buckets) > 2 and min(e.start_s for e in buckets) < last_backward_end
    assert sum(e.args["bytes"] for e in buckets) == stage_costs(overlapped).grad_bytes
    t_plain = summarize(run_sim(plain).events)["iteration_times_s"]
    t_overlap = summarize(run_sim(overlapped).events)["iteration_times_s"]
    assert all(a < b for a, b in zip(t_overlap, t_plain))


def test_distributed_optimizer_reduce_scatters_grads_and_gathers_params() -> None:
    s = dp_scenario({"distributed_optimizer": True})
    c = stage_costs(s)
    names = {e.name: e for e in run_sim(s).events[0]}
    assert names["dp_reduce_scatter"].args["bytes"] == c.grad_bytes
    assert names["dp_param_all_gather"].args["bytes"] == c.param_bytes
    assert c.model_mem_bytes < stage_costs(dp_scenario({})).model_mem_bytes


def test_overlapped_param_gathers_are_waited_by_the_next_iterations_forward() -> None:
    s = dp_scenario({"distributed_optimizer": True, "overlap_grad_reduce": True,
                     "overlap_param_gather": True})
    events = run_sim(s).events[0]
    gathers = [e for e in events if e.name == "dp_param_all_gather"]
    assert gathers and {e.args["iteration"] for e in gathers} == {1}  # only before iteration 1
    first_forward = min(e.start_s for e in events if e.name == "forward"
                        and e.args["iteration"] == 1)
    assert min(e.end_s for e in gathers) <= first_forward


@pytest.mark.parametrize("training", [{}, {"overlap_grad_reduce": True, "bucket_params": 10**6},
                                      {"distributed_optimizer": True, "overlap_grad_reduce": True,
                                       "overlap_param_gather": True}])
def test_one_replica_gives_the_full_simulations_iteration_times(training: dict) -> None:
    s = parse_scenario({"iterations": 2, "schedule": "interleaved",
                        "parallel": {"tp": 2, "pp": 2, "dp": 4, "vpp": 2, "microbatches": 4,
                                     "sequence_parallel": True},
                        "model": BIG_GRADS, "training": training, "cluster": SLOW_NICS})
    full = simulate_iteration_times(s)
    assert simulate_iteration_times(s, replica=True) == pytest.approx(full, rel=1e-12)


# ---------------------------------------------- options off: as before
def test_with_every_option_off_the_cost_model_is_the_gpt_flops_model() -> None:
    s = scenario({"tp": 2, "pp": 2})
    m, g = s.model, s.cluster.gpu
    b, seq, h = m.micro_batch_size, m.seq_len, m.hidden
    layer = 24 * b * seq * h * h + 4 * b * seq * seq * h  # Narayanan et al., 4h MLP
    c = stage_costs(s)
    assert c.forward_chunk_s == pytest.approx(2 * layer / 2 / (g.tflops * 1e12 * g.efficiency),
                                              rel=1e-12)
    assert c.backward_chunk_s == pytest.approx(2 * c.forward_chunk_s, rel=1e-12)
    assert c.recompute_chunk_s == 0 and c.embedding_forward_s == 0
    # bf16 gradients reduced in fp32, Megatron-LM's default (megatron_defaults.py)
    assert c.state_bytes_per_param == 18 and c.grad_bytes == 4 * c.params_per_rank
    assert c.activation_bytes == b * seq * h * 2


def test_fixed_costs_ignore_the_efficiency_model() -> None:
    data = {"schedule": "1f1b", "parallel": {"tp": 2, "pp": 2, "microbatches": 4},
            "model": TINY, "training": {"recompute": "full"},
            "costs": {"forward_s": 1.0, "backward_s": 2.0, "p2p_s": 0, "allreduce_s": 0,
                      "optimizer_s": 0},
            "cluster": {"gpu": {"gemm_overhead_us": 50, "module_overhead_us": 9,
                                "elementwise_traffic": 3}}}
    (t,) = summarize(run_sim(parse_scenario(data)).events)["iteration_times_s"]
    assert t == pytest.approx((4 + 2 - 1) * (1.0 + 2.0), rel=1e-12)


def test_op_overhead_delays_every_issued_operation() -> None:
    base = scenario({"pp": 1})
    slow = scenario({"pp": 1}, cluster={"gpu": {"op_overhead_us": 100}})
    ops = defaultdict(int)
    for e in run_sim(slow).events[0]:
        ops[e.args.get("iteration")] += 1
    (a,), (b,) = (summarize(run_sim(x).events)["iteration_times_s"] for x in (base, slow))
    # every op but the first (which precedes the iteration's first event) adds 100 µs
    assert b - a == pytest.approx((ops[0] - 1) * 100e-6, rel=1e-9)
