"""The pipeline step's own exchange (megatronapp/costs/pipeline_step.py): each
step of a pipelined rank waits for the point-to-point operations Megatron-core
queues on the pipeline communicator, each p2p_op_us plus latency plus bytes."""
from __future__ import annotations

from typing import Any

import pytest

from megatronapp.costs.per_op import stage_costs
from megatronapp.costs.pipeline_step import pipeline_step_s, queued_operations
from megatronapp.scenario.config import Scenario, parse_scenario
from sim import simulate_iteration_times

MODEL = {"layers": 16, "hidden": 1024, "heads": 8, "seq_len": 1024, "vocab": 1024}
LINKS = {"intra_node_gbps": 2400, "inter_node_gbps": 400, "intra_node_latency_us": 2,
         "inter_node_latency_us": 10}


def pipelined(pp: int, vpp: int = 1, op_us: float | None = 50.0, tp: int = 8,
              **parallel: Any) -> Scenario:
    gpu: dict[str, Any] = {"tflops": 400}
    if op_us is not None:
        gpu["p2p_op_us"] = op_us
    return parse_scenario({
        "schedule": "interleaved" if vpp > 1 else "1f1b",
        "parallel": {"tp": tp, "pp": pp, "vpp": vpp, "microbatches": 2 * pp, **parallel},
        "model": MODEL, "cluster": {"gpus_per_node": 8, "gpu": gpu, "links": LINKS}})


@pytest.mark.parametrize("pp, vpp, ops", [(2, 2, 1), (4, 1, 1), (4, 2, 2), (8, 2, 2)])
def test_two_operations_queue_in_the_interleaved_schedule_past_two_stages(
        pp: int, vpp: int, ops: int) -> None:
    assert queued_operations(pipelined(pp, vpp)) == ops


def test_a_step_waits_for_its_operations_each_with_latency_and_bytes() -> None:
    s = pipelined(4, 2)  # tp 8: the next stage is on the next node, over the NIC
    message = 1024 * 1024 * 2  # one microbatch's activation, bf16
    expected = 2 * (50e-6 + 10e-6 + message / (400e9 / 8))
    assert pipeline_step_s(s, message) == pytest.approx(expected, rel=1e-12)


def test_stages_on_one_node_exchange_over_nvlink() -> None:
    s = pipelined(4, 2, tp=2)  # 2 GPUs per stage: four stages on one node
    expected = 2 * (50e-6 + 2e-6 + 1000 / (2400e9 / 8))
    assert pipeline_step_s(s, 1000) == pytest.approx(expected, rel=1e-12)


def test_nothing_is_paid_without_p2p_op_us_or_without_a_pipeline() -> None:
    assert pipeline_step_s(pipelined(4, 2, op_us=None), 10**6) == 0.0
    assert pipeline_step_s(pipelined(1, 1), 10**6) == 0.0


def test_each_forward_and_backward_of_a_pipelined_chunk_holds_its_exchange() -> None:
    with_it, without = stage_costs(pipelined(4, 2)), stage_costs(pipelined(4, 2, op_us=None))
    step = pipeline_step_s(pipelined(4, 2), with_it.activation_bytes)
    assert with_it.forward_chunk_s - without.forward_chunk_s == pytest.approx(step, rel=1e-9)
    assert with_it.backward_chunk_s - without.backward_chunk_s == pytest.approx(step, rel=1e-9)


def test_a_pipelined_iteration_grows_by_at_least_its_busiest_ranks_exchanges() -> None:
    s, eager = pipelined(4, 2), pipelined(4, 2, op_us=None)
    (with_it,), (without,) = simulate_iteration_times(s), simulate_iteration_times(eager)
    p = s.parallel
    steps = 2 * p.microbatches * p.vpp  # a forward and a backward per microbatch and chunk
    step = pipeline_step_s(s, stage_costs(s).activation_bytes)
    assert with_it - without >= steps * step * (1 - 1e-9)
    assert with_it - without <= (steps + 2 * (p.pp - 1)) * step * (1 + 1e-9)  # and the fill
