"""Partial full recomputation (megatron-core's recompute_method / recompute_num_layers):
validated like Megatron, memory against Korthikanti et al. 2022, time and FLOPs
as the layers it recomputes."""
from __future__ import annotations

import json
import math
from typing import Any

import pytest

from megatronapp.scenario.config import ScenarioError, parse_scenario
from megatronapp.costs.per_op import Efficiency, layer_forward_s, stage_costs
from megatronapp.costs.flops import (hardware_flops_per_iteration, layer_forward_flops,
                               microbatches_per_iteration, model_flops_per_iteration)
from megatronapp.costs.memory import chunk_activation_bytes, rank_memory, transient_activation_bytes
from sim import simulate_iteration_times

S, B, H, A, T, LAYERS_PER_CHUNK = 512, 2, 1024, 8, 2, 4
BASE: dict[str, Any] = {
    "parallel": {"tp": T, "pp": 2, "dp": 2, "microbatches": 4, "sequence_parallel": True},
    "model": {"layers": 2 * LAYERS_PER_CHUNK, "hidden": H, "heads": A, "seq_len": S,
              "vocab": 4096, "micro_batch_size": B},
    "training": {"recompute": "full"},
}


def scenario(**training: Any) -> Any:
    data = json.loads(json.dumps(BASE))
    data["training"].update(training)
    return parse_scenario(data)


# Korthikanti et al. 2022, Table 2, tensor + sequence parallel, 16-bit activations
STORED_LAYER = S * B * H * (34 / T + 5 * A * S / (H * T))
CHECKPOINT = 2 * S * B * H / T


@pytest.mark.parametrize("training, field", [
    ({"recompute": "selective", "recompute_method": "block", "recompute_num_layers": 1},
     "training.recompute_method"),
    ({"recompute": "none", "recompute_num_layers": 1}, "training.recompute_num_layers"),
    ({"recompute_num_layers": 2}, "training.recompute_method"),
    ({"recompute_method": "uniform"}, "training.recompute_num_layers"),
    ({"recompute_method": "block", "recompute_num_layers": LAYERS_PER_CHUNK + 1},
     "training.recompute_num_layers"),
    ({"recompute_method": "blocks", "recompute_num_layers": 1}, "training.recompute_method"),
])
def test_megatrons_rules_are_enforced(training: dict[str, Any], field: str) -> None:
    with pytest.raises(ScenarioError) as err:
        scenario(**training)
    assert err.value.field == field


@pytest.mark.parametrize("k", range(1, LAYERS_PER_CHUNK + 1))
def test_block_stores_k_checkpoints_and_the_other_layers_whole(k: int) -> None:
    s = scenario(recompute_method="block", recompute_num_layers=k)
    expected = k * CHECKPOINT + (LAYERS_PER_CHUNK - k) * STORED_LAYER
    assert chunk_activation_bytes(s) == pytest.approx(expected, rel=1e-12)
    # 1F1B's first stage keeps p microbatches alive (Korthikanti §4.2.3)
    assert rank_memory(s, 0, 2, 0.0).activations == pytest.approx(2 * expected, rel=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_uniform_stores_one_checkpoint_per_group_and_rebuilds_a_group(n: int) -> None:
    s = scenario(recompute_method="uniform", recompute_num_layers=n)
    assert chunk_activation_bytes(s) == pytest.approx(
        math.ceil(LAYERS_PER_CHUNK / n) * CHECKPOINT, rel=1e-12)
    assert transient_activation_bytes(s) == pytest.approx(n * STORED_LAYER, rel=1e-12)


def test_block_recomputes_k_layers_of_each_chunk() -> None:
    s = scenario(recompute_method="block", recompute_num_layers=3)
    assert stage_costs(s).recompute_chunk_s == pytest.approx(
        3 * layer_forward_s(s, Efficiency.of(s)), rel=1e-12)
    extra = 3 * 2 * layer_forward_flops(s) * microbatches_per_iteration(s)  # 3 layers x pp 2
    assert hardware_flops_per_iteration(s) == pytest.approx(
        model_flops_per_iteration(s) + extra, rel=1e-12)


def iteration_s(s: Any) -> float:
    return simulate_iteration_times(s, True)[0]


def test_recomputing_more_layers_takes_longer_and_all_of_them_is_full() -> None:
    times = [iteration_s(scenario(recompute_method="block", recompute_num_layers=k))
             for k in range(1, LAYERS_PER_CHUNK + 1)]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert times[-1] == pytest.approx(iteration_s(scenario()), rel=1e-12)
    assert iteration_s(scenario(recompute="none")) < times[0]


def test_uniform_recomputes_every_layer() -> None:
    assert iteration_s(scenario(recompute_method="uniform", recompute_num_layers=2)) == \
        pytest.approx(iteration_s(scenario()), rel=1e-12)


def test_the_torch_stages_give_megatron_core_the_same_method() -> None:
    from backends.torch.stages import recompute_options

    assert recompute_options(scenario(recompute_method="block", recompute_num_layers=3)) == {
        "recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 3}
