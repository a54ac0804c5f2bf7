"""model.attention_backend: flash and fused attention keep only the softmax
statistics (memory against Korthikanti's Table 2 without its 5·a·s/h term) and
rebuild the scores in backward (one more scores GEMM per layer)."""
from __future__ import annotations

import json
from typing import Any

import pytest

from megatronapp.scenario.config import ScenarioError, parse_scenario
from megatronapp.costs.per_op import Efficiency, layer_forward_s, stage_costs
from megatronapp.costs.flops import layer_gemms
from megatronapp.costs.memory import layer_activation_bytes, transient_activation_bytes

S, B, H, A, T, LAYERS_PER_CHUNK = 512, 2, 1024, 8, 2, 4
BASE: dict[str, Any] = {
    "parallel": {"tp": T, "pp": 2, "dp": 2, "microbatches": 4, "sequence_parallel": True},
    "model": {"layers": 2 * LAYERS_PER_CHUNK, "hidden": H, "heads": A, "seq_len": S,
              "vocab": 4096, "micro_batch_size": B},
    "cluster": {"gpu": {"elementwise_traffic": 2.0}},
}


def scenario(backend: str | None, **training: Any) -> Any:
    data = json.loads(json.dumps(BASE))
    if backend is not None:
        data["model"]["attention_backend"] = backend
    data["training"] = training
    return parse_scenario(data)


SOFTMAX_STATS = 4 * A * S * B / T  # one fp32 per head and query, split over tp


@pytest.mark.parametrize("backend", ["flash", "fused"])
def test_flash_stores_no_scores_only_their_statistics(backend: str) -> None:
    # Korthikanti et al. 2022 Table 2 (tp + sp): s·b·h·(34/t + 5·a·s/(h·t)); flash drops the second term
    assert layer_activation_bytes(scenario(backend)) == pytest.approx(
        S * B * H * 34 / T + SOFTMAX_STATS, rel=1e-12)
    assert layer_activation_bytes(scenario("unfused")) == pytest.approx(
        S * B * H * (34 / T + 5 * A * S / (H * T)), rel=1e-12)
    assert transient_activation_bytes(scenario(backend, recompute="selective")) == \
        pytest.approx(SOFTMAX_STATS, rel=1e-12)


def test_unset_is_unfused() -> None:
    assert stage_costs(scenario(None)) == stage_costs(scenario("unfused"))


def test_flash_backward_rebuilds_the_scores_and_its_forward_moves_fewer_bytes() -> None:
    flash, unfused = stage_costs(scenario("flash")), stage_costs(scenario("unfused"))
    s = scenario("flash")
    rebuild = Efficiency.of(s).gemm_s(layer_gemms(s).scores / T / 2)  # causal: half computed
    assert flash.backward_chunk_s == pytest.approx(
        2.0 * flash.forward_chunk_s + LAYERS_PER_CHUNK * rebuild, rel=1e-12)
    assert flash.forward_chunk_s < unfused.forward_chunk_s


@pytest.mark.parametrize("backend", ["flash", "fused"])
def test_a_causal_kernel_computes_half_the_attention_core(backend: str) -> None:
    """Flash and fused attention skip the blocks above the diagonal; with no
    elementwise work or per-GEMM overhead, only that half differs."""
    quiet = {"elementwise_traffic": 0.0, "gemm_overhead_us": 0.0, "module_overhead_us": 0.0}
    times = {}
    for name in (backend, "unfused"):
        s = scenario(name)
        s = s.model_copy(update={"cluster": s.cluster.model_copy(
            update={"gpu": s.cluster.gpu.model_copy(update=quiet)})})
        times[name] = layer_forward_s(s, Efficiency.of(s))
    g = layer_gemms(scenario(None))
    core_s = (g.scores + g.attend) / T / Efficiency.of(scenario(None)).flops_per_s
    assert times["unfused"] - times[backend] == pytest.approx(core_s / 2, rel=1e-9)


def test_an_unknown_backend_is_refused_naming_the_field() -> None:
    with pytest.raises(ScenarioError) as err:
        scenario("flash2")
    assert err.value.field == "model.attention_backend"


def test_the_torch_backend_refuses_flash_in_one_line() -> None:
    from backends.torch import check_supported

    with pytest.raises(ScenarioError) as err:
        check_supported(scenario("flash"))
    assert err.value.field == "model.attention_backend"


def with_gpu(s: Any, **gpu: Any) -> Any:
    return s.model_copy(update={"cluster": s.cluster.model_copy(
        update={"gpu": s.cluster.gpu.model_copy(update=gpu)})})


@pytest.mark.parametrize("efficiency", [0.35, 0.8])
def test_flash_attention_runs_its_core_at_the_devices_flash_rate(efficiency: float) -> None:
    """With ``flash_attention_efficiency`` the causal half of the core runs at
    that share of peak instead of as GEMMs; only the core's time changes."""
    quiet = {"elementwise_traffic": 0.0, "gemm_overhead_us": 0.0, "module_overhead_us": 0.0}
    gemm_priced = with_gpu(scenario("flash"), **quiet)
    own_rate = with_gpu(gemm_priced, flash_attention_efficiency=efficiency)
    g = layer_gemms(gemm_priced)
    core_flops = (g.scores + g.attend) / T / 2  # per rank, causal half
    gpu = gemm_priced.cluster.gpu
    expected = (core_flops / (gpu.tflops * 1e12 * efficiency)
                - core_flops / (gpu.tflops * 1e12 * gpu.efficiency))
    assert (layer_forward_s(own_rate, Efficiency.of(own_rate))
            - layer_forward_s(gemm_priced, Efficiency.of(gemm_priced))) == pytest.approx(
        expected, rel=1e-9)


@pytest.mark.parametrize("backend", ["fused", "unfused"])
def test_a_flash_rate_leaves_other_attention_kernels_priced_as_gemms(backend: str) -> None:
    s = scenario(backend)
    assert stage_costs(with_gpu(s, flash_attention_efficiency=0.35)) == stage_costs(s)


@pytest.mark.parametrize("rate", [0, 1.5, "fast"])
def test_a_flash_rate_outside_0_to_1_is_refused_naming_the_field_and_1_is_kept(
        rate: Any) -> None:
    data = json.loads(json.dumps(BASE))
    data["cluster"]["gpu"]["flash_attention_efficiency"] = rate
    with pytest.raises(ScenarioError) as err:
        parse_scenario(data)
    assert err.value.field == "cluster.gpu.flash_attention_efficiency"
    data["cluster"]["gpu"]["flash_attention_efficiency"] = 1
    assert parse_scenario(data).cluster.gpu.flash_attention_efficiency == 1
