"""parallel.tp_comm_overlap: each sequence-parallel all-gather and reduce-scatter
runs under the GEMM it feeds or that produces it; only a collective longer than
its GEMM shows, by its excess."""
from __future__ import annotations

import json
from typing import Any

import pytest

from megatronapp.costs.per_op import Efficiency, layer_forward_s, stage_costs
from megatronapp.scenario.config import ScenarioError, parse_scenario
from sim import simulate_iteration_times

S, H, F, T, LAYERS = 4096, 1024, 4096, 2, 4
RATE = 100e12 * 0.5
QUIET = {"gemm_overhead_us": 0, "module_overhead_us": 0, "elementwise_traffic": 0,
         "tflops": 100.0, "efficiency": 0.5}
BASE: dict[str, Any] = {
    "parallel": {"tp": T, "pp": 2, "dp": 1, "microbatches": 4, "sequence_parallel": True,
                 "tp_comm_overlap": True},
    "model": {"layers": 2 * LAYERS, "hidden": H, "heads": 16, "seq_len": S, "vocab": 4096,
              "ffn_hidden_size": F},
    "cluster": {"gpu": QUIET},
}


def scenario(**changes: dict[str, Any]) -> Any:
    data = json.loads(json.dumps(BASE))
    for key, section in changes.items():
        data[key] = {**data.get(key, {}), **section}
    return parse_scenario(data)


def test_a_collective_longer_than_its_gemm_shows_by_its_excess() -> None:
    # one all-gather or reduce-scatter of the layer's bf16 activation: (t−1)/t·S/B
    gbps = 224.0
    comm = (T - 1) / T * S * H * 2 / (gbps * 1e9 / 8)
    s = scenario(cluster={"gpu": QUIET, "links": {"intra_node_gbps": gbps, "latency_us": 0}})
    gemms = {"qkv": 2 * S * H * 3 * H, "proj": 2 * S * H * H, "fc1": 2 * S * H * F,
             "fc2": 2 * S * F * H}
    gemm_s = {name: flops / T / RATE for name, flops in gemms.items()}
    assert gemm_s["proj"] < comm < min(gemm_s["qkv"], gemm_s["fc1"])  # only proj's shows
    c, layer = stage_costs(s), layer_forward_s(s, Efficiency.of(s))
    assert c.tp_layer_forward == c.tp_layer_backward == ()  # no collective of their own
    assert c.forward_chunk_s == pytest.approx(LAYERS * (layer + comm - gemm_s["proj"]), rel=1e-9)
    assert c.backward_chunk_s == pytest.approx(LAYERS * (2 * layer + comm - gemm_s["proj"]),
                                               rel=1e-9)


def test_collectives_within_nvlink_are_hidden_and_the_iteration_is_shorter() -> None:
    s, apart = scenario(), scenario(parallel={"tp_comm_overlap": False})
    assert stage_costs(s).forward_chunk_s == pytest.approx(
        LAYERS * layer_forward_s(s, Efficiency.of(s)), rel=1e-12)
    assert simulate_iteration_times(s, True)[0] < simulate_iteration_times(apart, True)[0]


@pytest.mark.parametrize("parallel", [{"sequence_parallel": False}, {"tp": 1}])
def test_it_needs_sequence_parallelism_as_in_megatron(parallel: dict[str, Any]) -> None:
    with pytest.raises(ScenarioError) as err:
        scenario(parallel=parallel)
    assert err.value.field == "parallel.tp_comm_overlap"


def test_the_torch_backend_refuses_it() -> None:
    from backends.torch import check_supported

    with pytest.raises(ScenarioError) as err:
        check_supported(scenario())
    assert err.value.field == "parallel.tp_comm_overlap"
