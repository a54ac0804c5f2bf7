"""Uneven pipeline splits (decoder_first/last_pipeline_num_layers,
account_for_embedding/loss_in_pipeline_split): each stage holds what
megatron-core builds there, its memory follows Korthikanti et al.'s per-layer
activations, and the pipeline's steady state runs at its heaviest stage."""
from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest

from megatronapp.costs.memory import layer_params, rank_memory, stage_params
from megatronapp.costs.per_op import stage_costs
from megatronapp.scenario.config import ScenarioError, parse_scenario
from megatronapp.scenario.pipeline_split import chunk_layers, first_layer, split_error
from sim import simulate_iteration_times

PP, LAYERS = 4, 16


def scenario(microbatches: int = 8, **parallel: Any) -> Any:
    """Links without cost, so that the iteration is compute alone."""
    return parse_scenario({
        "parallel": {"pp": PP, "microbatches": microbatches, **parallel},
        "model": {"layers": LAYERS, "hidden": 512, "heads": 8, "seq_len": 256, "vocab": 1024},
        "cluster": {"links": {"latency_us": 0, "intra_node_gbps": 1e8, "inter_node_gbps": 1e8}}})


def megatron_split(pp: int, vpp: int, layers: int, options: dict[str, Any]) -> Any:
    """megatron-core's own TransformerConfig, or the error it raises."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    names = {"decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
             "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(
            num_layers=layers, hidden_size=64, num_attention_heads=4,
            pipeline_model_parallel_size=pp, pipeline_dtype=torch.bfloat16,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            **{names.get(k, k): v for k, v in options.items()})


class Options:
    def __init__(self, pp: int, vpp: int, **options: Any):
        self.pp, self.vpp = pp, vpp
        self.decoder_first_pipeline_num_layers = options.get("decoder_first_pipeline_num_layers")
        self.decoder_last_pipeline_num_layers = options.get("decoder_last_pipeline_num_layers")
        self.account_for_embedding_in_pipeline_split = options.get(
            "account_for_embedding_in_pipeline_split", False)
        self.account_for_loss_in_pipeline_split = options.get(
            "account_for_loss_in_pipeline_split", False)


SPLITS = [dict(zip(("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"), pair))
          for pair in itertools.product((None, 1, 2, 3, 4, 6), repeat=2)]
SPLITS = [{k: v for k, v in d.items() if v is not None} for d in SPLITS]
SPLITS += [{"account_for_embedding_in_pipeline_split": True},
           {"account_for_loss_in_pipeline_split": True},
           {"account_for_embedding_in_pipeline_split": True,
            "account_for_loss_in_pipeline_split": True},
           {"decoder_first_pipeline_num_layers": 2, "account_for_loss_in_pipeline_split": True}]


@pytest.mark.parametrize("pp, vpp, layers", [(2, 1, 10), (4, 1, 14), (4, 2, 14), (4, 1, 16),
                                             (4, 2, 12), (3, 1, 8)])
@pytest.mark.parametrize("options", SPLITS)
def test_each_chunk_holds_what_megatron_core_builds_there(
        pp: int, vpp: int, layers: int, options: dict[str, Any]) -> None:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    p = Options(pp, vpp, **options)
    chunks = list(itertools.product(range(pp), range(vpp)))
    try:
        config = megatron_split(pp, vpp, layers, options)
        theirs = [(get_num_layers_to_build(config, c if vpp > 1 else None, r),
                   get_transformer_layer_offset(config, c if vpp > 1 else None, r))
                  for r, c in chunks]
        if min(n for n, _ in theirs) < 0:  # more layers fixed than the model has:
            raise ValueError("negative layers")  # megatron-core builds nonsense, refuse it
    except (ValueError, AssertionError):
        assert split_error(p, layers) is not None  # refused here as well
        return
    assert split_error(p, layers) is None
    assert [(chunk_layers(p, layers, r, c), first_layer(p, layers, r, c))
            for r, c in chunks] == theirs


@pytest.mark.parametrize("parallel, field", [
    ({"decoder_first_pipeline_num_layers": 20}, "parallel.decoder_first_pipeline_num_layers"),
    ({"decoder_first_pipeline_num_layers": 3}, "parallel.decoder_first_pipeline_num_layers"),
    ({"decoder_last_pipeline_num_layers": 0}, "parallel.decoder_last_pipeline_num_layers"),
    ({"decoder_first_pipeline_num_layers": 2, "account_for_embedding_in_pipeline_split": True},
     "parallel.decoder_first_pipeline_num_layers"),
    ({"account_for_embedding_in_pipeline_split": True}, "model.layers"),
    ({"pp": 1, "decoder_first_pipeline_num_layers": 4}, "parallel.pp"),
])
def test_splits_megatron_refuses_are_refused_naming_the_field(
        parallel: dict[str, Any], field: str) -> None:
    with pytest.raises(ScenarioError) as err:
        scenario(**parallel)
    assert err.value.field == field


UNEVEN = {"decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 3}


def test_a_stage_holds_the_weights_and_activations_of_its_own_layers() -> None:
    even, uneven = scenario(), scenario(**UNEVEN)  # 4 4 4 4 and 1 6 6 3 layers
    per_layer = sum(layer_params(even))  # tp = 1: nothing split
    # Korthikanti et al. 2022, Table 2, no parallelism: s·b·h·(34 + 5·a·s/h) per layer
    korthikanti = 256 * 512 * (34 + 5 * 8 * 256 / 512)
    for rank, layers in enumerate((1, 6, 6, 3)):
        assert stage_params(uneven, rank) - stage_params(even, rank) == (layers - 4) * per_layer
        peak = PP - rank  # 1F1B: stage r keeps pp - r microbatches alive
        assert rank_memory(uneven, rank, peak, 0.0).activations == peak * layers * korthikanti


def stage_busy_s(s: Any, rank: int) -> float:
    """One microbatch's forward and backward on stage ``rank``, with the
    embedding on the first and the output layer on the last."""
    c = stage_costs(s, rank)
    busy = c.forward_chunk_s + c.backward_chunk_s
    if rank == 0:
        busy += c.embedding_forward_s + c.embedding_backward_s
    if rank == PP - 1:
        busy += c.logits_forward_s + c.logits_backward_s
    return busy


@pytest.mark.parametrize("parallel", [UNEVEN, {"decoder_first_pipeline_num_layers": 7},
                                      {"decoder_first_pipeline_num_layers": 4,
                                       "decoder_last_pipeline_num_layers": 2}])
def test_one_microbatch_visits_every_stage_once(parallel: dict[str, Any]) -> None:
    s = scenario(microbatches=1, **parallel)
    optimizer = max(stage_costs(s, r).optimizer_s for r in range(PP))
    assert simulate_iteration_times(s, True)[0] == pytest.approx(
        sum(stage_busy_s(s, r) for r in range(PP)) + optimizer, rel=1e-6)


@pytest.mark.parametrize("parallel", [UNEVEN, {"decoder_first_pipeline_num_layers": 7},
                                      {"decoder_last_pipeline_num_layers": 1}])
def test_each_further_microbatch_costs_the_heaviest_stage(parallel: dict[str, Any]) -> None:
    t8, t16 = (simulate_iteration_times(scenario(m, **parallel), True)[0] for m in (8, 16))
    heaviest = max(stage_busy_s(scenario(**parallel), r) for r in range(PP))
    assert (t16 - t8) / 8 == pytest.approx(heaviest, rel=1e-6)


def test_the_torch_backend_refuses_an_uneven_split() -> None:
    from backends.torch import check_supported

    with pytest.raises(ScenarioError) as err:
        check_supported(scenario(**UNEVEN))
    assert err.value.field == "parallel"


@pytest.mark.parametrize("section, field", [
    ({"fbd": {}}, "fbd"),
    ({"scope": {"observe": [{"site": "logits"}]}}, "scope"),
])
def test_features_that_assume_an_even_split_refuse_an_uneven_one(section: dict[str, Any],
                                                                 field: str) -> None:
    with pytest.raises(ScenarioError) as err:
        parse_scenario({"parallel": {"pp": PP, **UNEVEN},
                        "model": {"layers": LAYERS, "hidden": 512, "heads": 8}, **section})
    assert err.value.field == field
