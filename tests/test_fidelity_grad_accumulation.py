"""training.gradient_accumulation_fusion (costs/grad_accumulation.py): with
Megatron's fusion (the default) the weight-gradient GEMM accumulates and no
pass runs; without it, as in Megatron-LM before 2022, each backward of a model
chunk is followed by a memory-bound pass over that chunk's parameters:
AccumulateGrad's in-place add (3 × the 16-bit gradient, from the second
microbatch on) or, with fp32 main gradients, the DDP hook's
``main_grad.add_(grad)`` (2 + 4 + 4 bytes, on every microbatch)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megatronapp.costs.memory import chunk_params
from megatronapp.program.ranks import static_compute_ops
from megatronapp.scenario.config import Scenario, parse_scenario

from .support import assert_refused_naming

PP, VPP, MICROBATCHES, HIDDEN, TP = 2, 2, 4, 512, 2


def scenario(fusion: bool, precision: str = "fp16", grad_reduce_in_fp32: bool = False,
             engine: str = "megatron") -> Scenario:
    interleaved = engine == "megatron"
    return parse_scenario({
        "schedule": "interleaved" if interleaved else "1f1b",
        "parallel": {"tp": TP, "pp": PP, "dp": 2, "vpp": VPP if interleaved else 1,
                     "microbatches": MICROBATCHES, "pipeline_engine": engine},
        "model": {"layers": 8, "hidden": HIDDEN, "heads": 8, "seq_len": 256, "vocab": 4096},
        "training": {"precision": precision, "grad_reduce_in_fp32": grad_reduce_in_fp32,
                     "gradient_accumulation_fusion": fusion},
    })


def backward_extra(unfused: Scenario, fused: Scenario) -> dict[tuple[int, int, int], float]:
    """(pp rank, chunk, microbatch) -> the backward's time without fusion minus with it."""
    ranks = [r * TP * 2 for r in range(PP)]  # tp 0, dp 0 of each stage
    ops = [static_compute_ops(x, ranks) for x in (unfused, fused)]
    extra: dict[tuple[int, int, int], float] = {}
    for rank in ranks:
        for slow, fast in zip(ops[0][rank], ops[1][rank]):
            if slow.name == "backward":
                key = (rank // (TP * 2), slow.meta["chunk"], slow.meta["microbatch"])
                extra[key] = extra.get(key, 0.0) + slow.cost_s - fast.cost_s
    return extra


@pytest.mark.parametrize("precision, fp32_grads, per_param, first", [
    ("fp16", False, 6, 1),  # AccumulateGrad: read new and old fp16, write the sum
    ("fp32", False, 12, 1),
    ("fp16", True, 10, 0),  # the hook: read the fp16 gradient, read and write fp32 main_grad
    ("bf16", False, 10, 0),  # Megatron-LM accumulates bf16 in fp32 main gradients
])
def test_without_fusion_each_chunks_backward_is_followed_by_a_pass_over_its_parameters(
        precision: str, fp32_grads: bool, per_param: int, first: int) -> None:
    unfused = scenario(False, precision, fp32_grads)
    extra = backward_extra(unfused, scenario(True, precision, fp32_grads))
    hbm = unfused.cluster.gpu.hbm_tbps * 1e12
    assert len(extra) == PP * VPP * MICROBATCHES
    for (pp_rank, chunk, microbatch), seconds in extra.items():
        expected = per_param * chunk_params(unfused, pp_rank, chunk) / hbm
        assert seconds == pytest.approx(expected if microbatch >= first else 0.0,
                                        rel=1e-9, abs=1e-15)


def test_a_chunks_parameters_count_the_embedding_only_where_megatron_builds_it() -> None:
    s = scenario(True)
    # four layers per stage, two per chunk: the same layers in every chunk, so
    # chunks differ by the embedding (first stage, chunk 0: padded vocabulary
    # and learned positions) and the final layer norm and tied output layer
    # (last stage, last chunk)
    embedding = s.padded_vocab * HIDDEN // TP
    middle = chunk_params(s, 0, 1)
    assert chunk_params(s, 1, 0) == middle
    assert chunk_params(s, 0, 0) - middle == embedding + 256 * HIDDEN
    assert chunk_params(s, 1, 1) - middle == embedding + 2 * HIDDEN


def test_deepspeeds_engine_runs_its_own_pass_whatever_megatrons_fusion_says() -> None:
    extra = backward_extra(scenario(True, engine="deepspeed"),
                           scenario(False, engine="deepspeed"))
    assert extra and all(seconds == 0.0 for seconds in extra.values())


def test_fusion_is_the_default_and_is_left_out_of_a_scenarios_dump() -> None:
    default = parse_scenario({})
    assert default.training.gradient_accumulation_fusion is True
    assert "gradient_accumulation_fusion" not in default.model_dump()["training"]
    assert scenario(False).model_dump()["training"]["gradient_accumulation_fusion"] is False


@pytest.mark.parametrize("value", ["x", 2, [True]])
def test_a_bad_setting_is_refused_naming_the_field(value: Any, tmp_path: Path) -> None:
    data = {"training": {"gradient_accumulation_fusion": value}}
    assert_refused_naming(data, "training.gradient_accumulation_fusion", tmp_path)
