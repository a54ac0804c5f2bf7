"""Memory and FLOPs against the papers' formulas, hand-computed here.

Korthikanti et al. 2022 (Table 2) for activations per layer, Megatron-core's
distributed-optimizer table for bytes per parameter, Narayanan et al. 2021
(Eq. 3) for FLOPs with full recomputation.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from megatronapp.scenario.config import Training, load_scenario, parse_scenario
from megatronapp.dpp.memory import MemoryExceeded
from megatronapp.costs.flops import hardware_flops_per_iteration
from megatronapp.dpp.static_memory import check_memory, stage_memory
from megatronapp.costs.memory import layer_activation_bytes, stage_params, state_bytes

ROOT = Path(__file__).resolve().parents[1]
S, B, H, A, T = 2048, 2, 12288, 96, 8  # GPT-3's sequence, hidden, heads; tp 8
SBH = S * B * H


def gpt(tp: int = T, sp: bool = False, recompute: str = "none", **model: object):
    return parse_scenario({
        "parallel": {"tp": tp, "sequence_parallel": sp},
        "model": {"layers": 2, "hidden": H, "heads": A, "seq_len": S, "micro_batch_size": B,
                  "vocab": 51200, **model},
        "training": {"recompute": recompute}})


@pytest.mark.parametrize("tp,sp,recompute,expected", [
    (1, False, "none", SBH * (34 + 5 * A * S / H)),           # no parallelism
    (T, False, "none", SBH * (10 + 24 / T + 5 * A * S / (H * T))),  # tensor parallel
    (T, True, "none", SBH * (34 / T + 5 * A * S / (H * T))),   # + sequence parallel
    (T, False, "selective", SBH * (10 + 24 / T)),              # tensor parallel + selective
    (T, True, "selective", SBH * 34 / T),                      # + sequence parallel
    (T, False, "full", 2 * SBH),                               # full: the layer's input
    (T, True, "full", 2 * SBH / T),
    (1, True, "none", SBH * (34 + 5 * A * S / H)),             # sp at tp 1: Megatron turns it off
])
def test_activations_per_layer_follow_korthikanti_table_2(tp: int, sp: bool, recompute: str,
                                                           expected: float) -> None:
    assert layer_activation_bytes(gpt(tp, sp, recompute)) == pytest.approx(expected, rel=1e-12)


def test_grouped_query_attention_and_swiglu_change_the_split_part() -> None:
    # The 24 of Korthikanti's 34 is Q·K 4 + V 2 + projection input 2 (attention),
    # GeLU input 8 + second projection input 8 (MLP), in units of s·b·h. With g
    # key/value groups K and V are g·d wide (d = h/a); SwiGLU keeps its 2f-wide
    # first-projection output and its f-wide product for the second projection.
    h, a, g, f, t = 4096, 32, 8, 11008, 2
    s = gpt(tp=t, hidden=h, heads=a, num_query_groups=g, ffn_hidden_size=f,
            activation="swiglu")
    sb, d = S * B, h // a
    split = sb * (2 * h + 2 * g * d) + sb * 2 * g * d + sb * 2 * h + sb * (4 * f + 2 * f)
    expected = 10 * sb * h + split / t + 5 * a * S * S * B / t
    assert layer_activation_bytes(s) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("precision,fp32_grads,dp,expected", [
    ("bf16", True, 1, 18), ("bf16", True, 8, 6 + 12 / 8),    # bf16 weights, fp32 grads
    ("fp16", False, 1, 20), ("fp16", False, 8, 4 + 16 / 8),  # fp16 weights and grads
    ("fp32", False, 1, 16), ("fp32", False, 8, 8 + 8 / 8),
    ("bf16", False, 1, 16),  # 16-bit grads, no fp32 copy: the default, as before
])
def test_bytes_per_parameter_follow_megatrons_distributed_optimizer_table(
        precision: str, fp32_grads: bool, dp: int, expected: float) -> None:
    t = Training(precision=precision, grad_reduce_in_fp32=fp32_grads,  # type: ignore[arg-type]
                 distributed_optimizer=dp > 1)
    assert state_bytes(t, dp).total == pytest.approx(expected, rel=1e-12)


def test_parameters_of_a_one_stage_gpt() -> None:
    # 12·l·h² + 13·l·h weights and biases per layer, word and position
    # embeddings, final layer norm; the output layer is the tied embedding
    # (the vocabulary unpadded: test_fidelity_vocab.py covers the padding).
    l, h, v, s = 4, 256, 1000, 128
    scen = parse_scenario({"model": {"layers": l, "hidden": h, "heads": 4, "seq_len": s,
                                     "vocab": v, "make_vocab_size_divisible_by": 1}})
    assert stage_params(scen, 0) == 12 * l * h * h + 13 * l * h + v * h + s * h + 2 * h
    untied = parse_scenario({**scen.model_dump(mode="json"),
                             "model": {**scen.model.model_dump(), "untie_embeddings": True}})
    assert stage_params(untied, 0) == stage_params(scen, 0) + v * h


@pytest.mark.parametrize("schedule,pp,vpp", [("1f1b", 4, 1), ("interleaved", 4, 2),
                                             ("interleaved", 2, 3)])
def test_first_stage_activations_match_korthikanti_section_4(schedule: str, pp: int,
                                                             vpp: int) -> None:
    # The first stage keeps L layers' activations under 1F1B, and
    # L·(1 + (p-1)/(p·v)) under the interleaved schedule.
    layers = 12 * pp * vpp
    s = parse_scenario({"schedule": schedule,
                        "parallel": {"pp": pp, "vpp": vpp, "microbatches": 4 * pp},
                        "model": {"layers": layers, "hidden": 1024, "heads": 16,
                                  "seq_len": 1024}})
    factor = 1 if schedule == "1f1b" else 1 + (pp - 1) / (pp * vpp)
    expected = layers * factor * layer_activation_bytes(s)
    assert stage_memory(s)[0].activations == pytest.approx(expected, rel=1e-12)


def test_eq3_counts_the_flops_of_a_narayanan_row() -> None:
    s = load_scenario(ROOT / "scenarios" / "published" / "narayanan2021" / "row05.yaml")
    batch, l, h, v, seq = 1536, 48, 8192, 51200, 2048
    eq3 = 96 * batch * seq * l * h * h * (1 + seq / (6 * h) + v / (16 * l * h))
    assert hardware_flops_per_iteration(s) == pytest.approx(eq3, rel=1e-12)


# ------------------------------------------------------------- GPT-3 175B
OFF = ["parallel.sequence_parallel=false", "training.recompute=none",
       "training.distributed_optimizer=false", "training.overlap_param_gather=false",
       "training.overlap_grad_reduce=false"]


def test_gpt3_175b_fits_in_80_gb_with_megatrons_options() -> None:
    s = load_scenario(ROOT / "scenarios" / "gpt3_175b.yaml")
    check_memory(s)
    assert max(m.total for m in stage_memory(s).values()) < 80e9


def test_gpt3_175b_without_the_options_names_what_would_make_it_fit() -> None:
    s = load_scenario(ROOT / "scenarios" / "gpt3_175b.yaml", OFF)
    with pytest.raises(MemoryExceeded) as err:
        check_memory(s)
    assert err.value.peak_bytes > 80e9
    assert "it fits with training.recompute: full" in err.value.reason


def test_each_option_alone_is_named_when_it_suffices() -> None:
    s = load_scenario(ROOT / "scenarios" / "gpt3_175b.yaml", OFF[:2] + OFF[3:])
    with pytest.raises(MemoryExceeded) as err:
        check_memory(s)
    for option in ("parallel.sequence_parallel: true", "training.recompute: selective"):
        assert option in err.value.reason


def test_every_table1_row_and_fidelity_scenario_loads_and_fits() -> None:
    paths = sorted((ROOT / "scenarios" / "published" / "narayanan2021").glob("row*.yaml"))
    assert len(paths) == 10
    for path in paths + sorted((ROOT / "scenarios" / "fidelity").glob("*.yaml")):
        check_memory(load_scenario(path))
