"""Memory per rank against Megatron's own accounting: report_theoretical_memory
(megatron/training/theoretical_memory_usage.py at core_v0.16.1), written out
from its formulas in costs/theoretical_memory.py, and Korthikanti et al.'s
Table 2 for what dropout keeps.
Where their assumptions hold (multi-head attention, a 4h MLP, sequence
parallelism with selective recomputation) the two counts agree."""
from __future__ import annotations

from typing import Any

import pytest

from megatronapp.costs.memory import layer_activation_bytes, output_layer_bytes
from megatronapp.costs.theoretical_memory import theoretical_memory
from megatronapp.dpp.static_memory import stage_memory
from megatronapp.scenario.config import Scenario, load_scenario, parse_scenario

from .support import ROOT


def megatron_theoretical(s: Scenario) -> tuple[float, float]:
    estimate = theoretical_memory(s)
    return estimate.weights_and_optimizer, estimate.activations


def sp_selective(pp: int, vpp: int, dp: int, microbatches: int, **model: Any) -> Scenario:
    return parse_scenario({
        "schedule": "interleaved" if vpp > 1 else "1f1b",
        "parallel": {"tp": 8, "pp": pp, "vpp": vpp, "dp": dp, "microbatches": microbatches,
                     "sequence_parallel": True},
        "model": {"layers": 48, "hidden": 6144, "heads": 48, "seq_len": 4096, "vocab": 51200,
                  "position_embedding_type": "rope", **model},
        "training": {"recompute": "selective", "distributed_optimizer": True}})


@pytest.mark.parametrize("pp, vpp, dp, microbatches", [
    (1, 1, 8, 4), (2, 1, 1, 1), (4, 1, 8, 8), (4, 3, 8, 8), (8, 6, 2, 16)])
def test_the_first_stage_holds_what_megatrons_theoretical_memory_counts(
        pp: int, vpp: int, dp: int, microbatches: int) -> None:
    s = sp_selective(pp, vpp, dp, microbatches)
    first = stage_memory(s)[0]
    state, activations = megatron_theoretical(s)
    assert first.weights + first.grads + first.optimizer == pytest.approx(state, rel=0.005)
    # the loss's logits are the last stage's, a transient here; Megatron counts them at pp 1
    logits = output_layer_bytes(s) if pp == 1 else 0.0
    assert first.activations + logits == pytest.approx(activations, rel=0.01)


def test_without_dropout_a_layer_keeps_no_masks() -> None:
    """Korthikanti's 34·s·b·h holds two 1-byte hidden dropout masks and, unfused,
    5·a·s²·b of scores of which the mask (1) and the dropout output (2) go
    without attention dropout: 32·s·b·h and 2·a·s²·b."""
    common = {"parallel": {"tp": 1}, "model": {"layers": 2, "hidden": 1024, "heads": 8,
                                                "seq_len": 512, "attention_backend": "unfused"}}
    def layer(hidden: float, attention: float) -> float:
        return layer_activation_bytes(parse_scenario({**common, "model": {
            **common["model"], "hidden_dropout": hidden, "attention_dropout": attention}}))
    sbh, as2b = 512 * 1024, 8 * 512 * 512
    assert layer(0.1, 0.1) == 34 * sbh + 5 * as2b
    assert layer(0.0, 0.1) == 32 * sbh + 5 * as2b
    assert layer(0.1, 0.0) == 34 * sbh + 2 * as2b


def test_the_last_stage_holds_one_microbatchs_fp32_logits() -> None:
    s = sp_selective(4, 1, 8, 8)
    memory = stage_memory(s)
    extra = memory[3].transient - memory[1].transient
    assert extra == 4 * 4096 * (6144 + 51200) / 8


NEMOTRON_340B = ROOT / "scenarios" / "memory" / "nemotron4_340b.yaml"


def peak_gb(grads_in_fp32: bool, dropout: float) -> float:
    s = load_scenario(NEMOTRON_340B, [f"training.grad_reduce_in_fp32={grads_in_fp32}",
                                      f"model.hidden_dropout={dropout}",
                                      f"model.attention_dropout={dropout}"])
    return max(m.total for m in stage_memory(s).values()) / 1e9


def test_the_340b_row_fits_an_h100_only_with_16_bit_gradients_and_no_dropout() -> None:
    """A 340B run that ran on 128 H100s (96 layers, hidden 18,432, GQA with 8 groups,
    tp 8, pp 8, vpp 12, dp 2): Megatron's own theoretical memory and this count both
    put it above the device with fp32 gradients; 16-bit gradients and no dropout
    masks (as Nemotron trains) bring it within 81,559 MiB."""
    device_gb = load_scenario(NEMOTRON_340B).cluster.gpu.memory_gb
    assert device_gb == pytest.approx(81559 * 2**20 / 1e9, rel=1e-3)
    assert peak_gb(True, 0.1) > peak_gb(True, 0.0) > device_gb
    assert peak_gb(False, 0.1) > device_gb > peak_gb(False, 0.0)
    megatron = sum(megatron_theoretical(load_scenario(NEMOTRON_340B))) / 1e9
    assert megatron > peak_gb(True, 0.1)  # it counts K and V as wide as Q
