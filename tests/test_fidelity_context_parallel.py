"""Context parallelism (parallel.context_parallel_size): the sequence split over
cp ranks, activations ÷ cp against Korthikanti et al.'s formulas, the K/V ring
hidden behind attention where it can be and exposed where it cannot, and the
dp·cp group gradients are reduced over."""
from __future__ import annotations

import json
from typing import Any

import pytest

from megatronapp.costs.memory import layer_activation_bytes
from megatronapp.costs.per_op import Efficiency, layer_forward_s, scores_rebuild_s, stage_costs
from megatronapp.program.layout import topology_of
from megatronapp.scenario.config import ScenarioError, parse_scenario

S, B, H, A, G, T, LAYERS = 8192, 1, 1024, 16, 4, 2, 4
BASE: dict[str, Any] = {
    "parallel": {"tp": T, "pp": 2, "dp": 2, "microbatches": 4, "sequence_parallel": True},
    "model": {"layers": 2 * LAYERS, "hidden": H, "heads": A, "num_query_groups": G,
              "seq_len": S, "vocab": 4096, "micro_batch_size": B, "attention_backend": "flash"},
}


def scenario(cp: int, **sections: dict[str, Any]) -> Any:
    data = json.loads(json.dumps(BASE))
    data["parallel"]["context_parallel_size"] = cp
    for key, section in sections.items():
        data[key] = {**data.get(key, {}), **section}
    return parse_scenario(data)


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_each_layer_keeps_a_cp_th_of_korthikantis_activations(cp: int) -> None:
    # Korthikanti et al. 2022, Table 2, tensor + sequence parallel: s·b·h·34/t, with
    # flash attention's fp32 softmax statistics (4·a·s·b/t) instead of 5·a·s²·b/t;
    # each cp rank holds s/cp of the sequence
    local = S // cp
    expected = local * B * H * 34 / T + 4 * A * local * B / T
    mha = scenario(cp, model={"num_query_groups": A})  # the 34 counts full-width K and V
    assert layer_activation_bytes(mha) == pytest.approx(expected, rel=1e-12)


def test_a_layer_runs_a_cp_th_of_its_gemm_flops_on_each_rank() -> None:
    """With no per-GEMM overhead and nothing elementwise, time is FLOPs ÷ rate."""
    quiet = {"gemm_overhead_us": 0, "module_overhead_us": 0, "elementwise_traffic": 0}
    times = [layer_forward_s(s, Efficiency.of(s))
             for s in (scenario(cp, cluster={"gpu": quiet}) for cp in (1, 2, 4))]
    assert times[1] == pytest.approx(times[0] / 2, rel=1e-12)
    assert times[2] == pytest.approx(times[0] / 4, rel=1e-12)


SLOW_RING = {"gpus_per_node": 2, "links": {"inter_node_gbps": 1.0, "inter_node_latency_us": 50}}
QUIET = {"gemm_overhead_us": 0, "module_overhead_us": 0, "elementwise_traffic": 0,
         "tflops": 100.0, "efficiency": 0.5}


@pytest.mark.parametrize("cp", [2, 4])
def test_a_ring_slower_than_attention_exposes_what_the_attention_does_not_hide(cp: int) -> None:
    s = scenario(cp, cluster={**SLOW_RING, "gpu": QUIET})  # tp·cp > 2 GPUs a node: across nodes
    local = S // cp
    kv_bytes = 2 * B * local * (G // T) * (H // A) * 2  # K and V of one chunk, bf16
    transfer = kv_bytes / (1e9 / 8) + 50e-6
    # QKᵀ and attention·V on one chunk, half of it computed (causal flash attention)
    step = 2 * 2 * B * local * local * H / T / (100e12 * 0.5) / 2
    assert transfer > 2 * step  # the ring is exposed in both directions
    c, layer = stage_costs(s), layer_forward_s(s, Efficiency.of(s))
    assert c.forward_chunk_s == pytest.approx(LAYERS * (layer + (cp - 1) * (transfer - step)),
                                              rel=1e-9)
    rebuild = scores_rebuild_s(s, Efficiency.of(s))  # flash's QKᵀ again
    backward = 2 * layer + rebuild + (cp - 1) * (2 * transfer - 2 * step)  # K, V and gradients
    assert c.backward_chunk_s == pytest.approx(LAYERS * backward, rel=1e-9)


def test_a_ring_within_a_node_hides_behind_the_attention() -> None:
    s = scenario(2)  # tp·cp = 4 GPUs of a node at NVLink speed
    assert stage_costs(s).forward_chunk_s == pytest.approx(
        LAYERS * layer_forward_s(s, Efficiency.of(s)), rel=1e-12)


def test_gradients_are_reduced_over_dp_times_cp_ranks_in_megatrons_order() -> None:
    cp = 4
    s = scenario(cp)
    topo = topology_of(s)
    assert s.world_size == topo.world_size == T * cp * 2 * 2
    # megatron-core's default order tp-cp-dp-pp: rank = t + T·(c + cp·(d + D·p))
    expected = tuple(sorted(1 + T * (c + cp * (d + 2 * 1)) for c in range(cp) for d in range(2)))
    assert topo.dp_group(1 + T * cp * 2) == expected


@pytest.mark.parametrize("change, field", [
    ({"model": {"attention_backend": "unfused"}}, "parallel.context_parallel_size"),
    ({"model": {"seq_len": 8196}}, "model.seq_len"),  # not divisible by 2·cp = 8
    ({"cluster": {"nodes": 2}}, "parallel"),  # 16 GPUs for tp·cp·pp·dp = 32
])
def test_what_megatron_refuses_is_refused_naming_the_field(change: dict[str, Any],
                                                           field: str) -> None:
    with pytest.raises(ScenarioError) as err:
        scenario(4, **change)
    assert err.value.field == field


def test_the_torch_backend_refuses_context_parallelism() -> None:
    from backends.torch import check_supported

    with pytest.raises(ScenarioError) as err:
        check_supported(scenario(2))
    assert err.value.field == "parallel.context_parallel_size"


@pytest.mark.parametrize("cp", [2, 4])
def test_gathering_k_and_v_first_exposes_the_whole_gather(cp: int) -> None:
    """cp_comm_type all_gather: one all-gather of every rank's K and V before
    attention, again in backward with the gradients' reduce-scatter."""
    s = scenario(cp, parallel={"cp_comm_type": "all_gather"},
                 cluster={**SLOW_RING, "gpu": QUIET})
    kv_bytes = 2 * B * (S // cp) * (G // T) * (H // A) * 2  # one rank's K and V, bf16
    gather = (cp - 1) / cp * cp * kv_bytes / (1e9 / 8) + (cp - 1) * 50e-6
    c, eff = stage_costs(s), Efficiency.of(s)
    layer = layer_forward_s(s, eff)
    assert c.forward_chunk_s == pytest.approx(LAYERS * (layer + gather), rel=1e-9)
    assert c.backward_chunk_s == pytest.approx(
        LAYERS * (2 * layer + scores_rebuild_s(s, eff) + 2 * gather), rel=1e-9)
