"""parallel.async_tp_backward: a column-parallel layer's backward reduces its
input gradient under its weight-gradient GEMM (with sequence parallelism its
input is also gathered again under the input-gradient GEMM), as Megatron-LM's
LinearWithGradAccumulationAndAsyncCommunication does; only a collective longer
than its GEMM shows, by its excess."""
from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from megatronapp.costs.per_op import Efficiency, layer_forward_s, stage_costs
from megatronapp.scenario.config import ScenarioError, parse_scenario
from sim import simulate_iteration_times

S, H, F, T, LAYERS = 4096, 1024, 4096, 2, 4
RATE = 100e12 * 0.5
QUIET = {"gemm_overhead_us": 0, "module_overhead_us": 0, "elementwise_traffic": 0,
         "tflops": 100.0, "efficiency": 0.5}
GBPS = 112.0  # one ring pass of the activation between the QKV and the first MLP GEMM
BASE: dict[str, Any] = {
    "parallel": {"tp": T, "pp": 2, "dp": 1, "microbatches": 4, "sequence_parallel": True,
                 "async_tp_backward": True},
    "model": {"layers": 2 * LAYERS, "hidden": H, "heads": 16, "seq_len": S, "vocab": 4096,
              "ffn_hidden_size": F},
    "cluster": {"gpu": QUIET, "links": {"intra_node_gbps": GBPS, "latency_us": 0}},
}


def scenario(**changes: dict[str, Any]) -> Any:
    data = json.loads(json.dumps(BASE))
    for key, section in changes.items():
        data[key] = {**data.get(key, {}), **section}
    return parse_scenario(data)


def ring_pass_s(gbps: float = GBPS) -> float:
    """An all-gather or reduce-scatter of the layer's bf16 activation: (t−1)/t·S/B."""
    return (T - 1) / T * S * H * 2 / (gbps * 1e9 / 8)


def column_gemm_s() -> dict[str, float]:
    return {"qkv": 2 * S * H * 3 * H / T / RATE, "fc1": 2 * S * H * F / T / RATE}


def test_sequence_parallel_backward_keeps_the_row_all_gathers_and_shows_only_the_excess() -> None:
    comm, gemm = ring_pass_s(), column_gemm_s()
    assert gemm["qkv"] < comm < gemm["fc1"]  # only the QKV GEMM is too short to hide them
    s = scenario()
    c, layer = stage_costs(s), layer_forward_s(s, Efficiency.of(s))
    assert c.tp_layer_forward == ("all_gather", "reduce_scatter", "all_gather", "reduce_scatter")
    assert c.tp_layer_backward == ("all_gather", "all_gather")  # the row-parallel layers'
    # the re-gather under QKV's input gradient, the reduce-scatter under its weight gradient
    exposed = 2 * (comm - gemm["qkv"])
    assert c.backward_chunk_s == pytest.approx(LAYERS * (2 * layer + exposed), rel=1e-9)
    assert c.forward_chunk_s == pytest.approx(
        stage_costs(scenario(parallel={"async_tp_backward": False})).forward_chunk_s, rel=1e-12)


def test_without_sequence_parallelism_the_input_gradient_all_reduce_runs_under_wgrad() -> None:
    gbps = 2 * GBPS  # an all-reduce, two ring passes, between the two GEMMs again
    comm, gemm = 2 * ring_pass_s(gbps), column_gemm_s()
    assert gemm["qkv"] < comm < gemm["fc1"]
    s = scenario(parallel={"sequence_parallel": False},
                 cluster={"gpu": QUIET, "links": {"intra_node_gbps": gbps, "latency_us": 0}})
    c, layer = stage_costs(s), layer_forward_s(s, Efficiency.of(s))
    assert c.tp_layer_forward == ("all_reduce", "all_reduce")
    assert c.tp_layer_backward == ()
    assert c.backward_chunk_s == pytest.approx(LAYERS * (2 * layer + comm - gemm["qkv"]),
                                               rel=1e-9)


@settings(max_examples=25, deadline=None)
@given(tp=st.sampled_from([2, 4, 8]), gbps=st.floats(10.0, 5000.0),
       hidden=st.sampled_from([512, 1024, 2048]))
def test_an_async_all_reduce_never_makes_the_iteration_longer(tp: int, gbps: float,
                                                               hidden: int) -> None:
    links = {"intra_node_gbps": gbps, "latency_us": 5}
    changes = {"parallel": {"tp": tp, "sequence_parallel": False},
               "model": {"hidden": hidden, "heads": 16, "ffn_hidden_size": 4 * hidden},
               "cluster": {"gpu": QUIET, "links": links}}
    on = scenario(**changes)
    off = scenario(**{**changes, "parallel": {**changes["parallel"], "async_tp_backward": False}})
    assert simulate_iteration_times(on, True)[0] <= simulate_iteration_times(off, True)[0] + 1e-12


def test_tp_comm_overlap_takes_the_collectives_over() -> None:
    both = scenario(parallel={"tp_comm_overlap": True})
    alone = scenario(parallel={"tp_comm_overlap": True, "async_tp_backward": False})
    assert stage_costs(both) == stage_costs(alone)


def test_the_torch_backend_refuses_it() -> None:
    from backends.torch import check_supported

    with pytest.raises(ScenarioError) as err:
        check_supported(scenario())
    assert err.value.field == "parallel.async_tp_backward"
