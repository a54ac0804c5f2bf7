"""The vocabulary as Megatron builds it (``model.make_vocab_size_divisible_by``):
padded to a multiple of the setting × tp (megatron/training/tokenizer/tokenizer.py
``_vocab_size_with_padding``), and the embedding, the logits GEMM, the loss
over the logits, the tied embedding's gradient and the FLOPs priced on the
padded size; 1 pads it to a multiple of tp alone (each rank an equal share),
and an aligned vocabulary is unchanged."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatronapp.costs.flops import logits_forward_flops
from megatronapp.costs.gemm import GemmShape, rank_logits_shape
from megatronapp.costs.memory import stage_params
from megatronapp.costs.per_op import Efficiency, output_layer_s, stage_costs
from megatronapp.scenario.config import Scenario, parse_scenario

from .support import assert_refused_naming

# MT-NLG's shape (Smith et al. 2022): the GPT-2 vocabulary, 8-way tensor slicing.
GPT2_VOCAB, TP, HIDDEN, SEQ, MICRO = 50257, 8, 2048, 256, 2


def scenario(vocab: int = GPT2_VOCAB, divisible_by: int | None = None, tp: int = TP,
             pp: int = 2) -> Scenario:
    model: dict[str, Any] = {"layers": 4, "hidden": HIDDEN, "heads": 16, "seq_len": SEQ,
                             "vocab": vocab, "micro_batch_size": MICRO}
    if divisible_by is not None:
        model["make_vocab_size_divisible_by"] = divisible_by
    return parse_scenario({"parallel": {"tp": tp, "pp": pp, "dp": 1, "microbatches": 4},
                           "model": model})


@given(vocab=st.integers(1, 300_000), divisible_by=st.integers(1, 512),
       tp=st.sampled_from([1, 2, 4, 8]))
def test_the_padded_vocabulary_is_the_least_multiple_of_the_setting_times_tp(
        vocab: int, divisible_by: int, tp: int) -> None:
    padded = scenario(vocab, divisible_by, tp, pp=1).padded_vocab
    multiple = divisible_by * tp
    assert padded % multiple == 0
    assert vocab <= padded < vocab + multiple


def test_megatrons_default_pads_the_gpt2_vocabulary_at_tp_8_to_51200() -> None:
    # ceil(50,257 / (128·8))·128·8 = 50·1,024
    assert scenario().padded_vocab == 50 * 1024
    assert scenario(divisible_by=1).padded_vocab == 6283 * 8  # a multiple of tp alone


def test_the_logits_gemm_the_loss_and_the_flops_use_the_padded_vocabulary() -> None:
    s = scenario()
    per_rank = 51200 // TP
    assert rank_logits_shape(s) == GemmShape(MICRO * SEQ, per_rank, HIDDEN)
    eff = Efficiency.of(s)
    # the GEMM, then the loss reading the fp32 logits (4 bytes each), then the call
    assert output_layer_s(s, eff) == pytest.approx(
        eff.shape_s(GemmShape(MICRO * SEQ, per_rank, HIDDEN))
        + eff.memory_s(MICRO * SEQ * per_rank * 4) + eff.module_overhead_s, rel=1e-12)
    assert logits_forward_flops(s) == 2 * MICRO * SEQ * HIDDEN * 51200


def test_the_embedding_and_its_tied_gradient_hold_the_padded_rows() -> None:
    padded, by_tp = scenario(), scenario(divisible_by=1)
    extra_rows = (51200 - 6283 * 8) * HIDDEN // TP
    for stage in (0, 1):  # the word embedding on the first, its tied copy on the last
        assert stage_params(padded, stage) - stage_params(by_tp, stage) == extra_rows
    grads = [stage_costs(x, 0).embedding_grad_bytes for x in (padded, by_tp)]
    assert grads[0] == 51200 * HIDDEN // TP * 4  # bf16 gradients, reduced in fp32
    assert grads[1] == 6283 * HIDDEN * 4


def test_an_aligned_vocabulary_is_priced_as_before() -> None:
    aligned = 51200  # Narayanan et al.'s rows: a multiple of 128·8
    assert stage_costs(scenario(aligned)) == stage_costs(scenario(aligned, divisible_by=1))


def test_the_default_is_left_out_of_a_scenarios_dump() -> None:
    assert "make_vocab_size_divisible_by" not in scenario().model_dump()["model"]
    assert scenario(divisible_by=1).model_dump()["model"]["make_vocab_size_divisible_by"] == 1


@pytest.mark.parametrize("value", [0, -128, 1.5, "x"])
def test_a_bad_setting_is_refused_naming_the_field(value: Any, tmp_path: Path) -> None:
    data = {"model": {"vocab": 1000, "make_vocab_size_divisible_by": value}}
    assert_refused_naming(data, "model.make_vocab_size_divisible_by", tmp_path)
