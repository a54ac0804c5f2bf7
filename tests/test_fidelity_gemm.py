"""GEMMs by shape: the size-dependent efficiency saturates, wave quantisation
steps at multiples of the SM count, the roofline bounds thin GEMMs by HBM,
the per-rank shapes hold the layer's FLOPs, and a device without geometry
keeps the FLOPs-at-one-efficiency model."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from megatronapp.costs.flops import layer_gemms, logits_forward_flops
from megatronapp.costs.gemm import GemmDevice, GemmShape, rank_layer_shapes, rank_logits_shape
from megatronapp.costs.per_op import Efficiency, layer_forward_s
from megatronapp.fidelity.fit import with_settings
from megatronapp.fidelity.published import (A100_2021, GEMM_HALF_KNOB, TABLE1_KNOBS, PublishedRun,
                                            fit_generation, published_runs)
from megatronapp.scenario.config import Scenario, parse_scenario
from sim import simulate_iteration_times

from .support import ROOT

PEAK = 989e12


def replica_time(s: Scenario) -> float:
    return simulate_iteration_times(s, replica=True)[0]


def device(sm: int | None = 132, half: float = 0.0, tiles=((128, 128),)) -> GemmDevice:
    return GemmDevice(PEAK, 0.7, half, 0.0, 3.35e12, sm, tiles)


@given(st.floats(1e3, 1e12), st.floats(1.01, 100), st.floats(1e6, 1e12))
def test_size_efficiency_rises_with_flops_towards_the_large_gemm_efficiency(
        flops: float, grow: float, half: float) -> None:
    d = device(half=half)
    assert d.size_efficiency(flops) < d.size_efficiency(flops * grow) < d.efficiency
    assert d.size_efficiency(half) == pytest.approx(d.efficiency / 2)
    assert device(half=0.0).size_efficiency(flops) == pytest.approx(d.efficiency, rel=1e-15)


@given(st.integers(1, 8), st.integers(1, 64).map(lambda k: 64 * k), st.floats(1e8, 1e11))
def test_achieved_rate_grows_with_the_gemm_in_whole_waves(waves: int, k: int, half: float) -> None:
    """m grown by whole waves of tiles: more FLOPs, a higher share of peak."""
    d = device(half=half)
    shapes = [GemmShape(128 * 132 * w, 128, k) for w in (waves, waves + 1)]
    rates = [shape.flops / d.seconds(shape, roofline=False) for shape in shapes]
    assert rates[0] < rates[1] < PEAK * d.efficiency


def test_wave_quantisation_steps_at_multiples_of_the_sm_count() -> None:
    """One 128×128 tile per SM: 1 to 132 tiles take one wave's time, 133 two."""
    d = device(sm=132)
    one_wave = d.seconds(GemmShape(128, 128, 4096), roofline=False)
    times = {tiles: d.seconds(GemmShape(128 * tiles, 128, 4096), roofline=False)
             for tiles in (1, 67, 132, 133, 264, 265)}
    waves = {tiles: seconds / one_wave for tiles, seconds in times.items()}
    assert waves == pytest.approx({1: 1, 67: 1, 132: 1, 133: 2, 264: 2, 265: 3}, rel=1e-12)
    assert times[132] == pytest.approx(GemmShape(128 * 132, 128, 4096).flops / (PEAK * 0.7))


def test_the_kernel_takes_the_tile_that_wastes_least() -> None:
    """n = 128: a 256-wide tile would pad half of every tile; a 128-wide one does not."""
    shape = GemmShape(256 * 132, 128, 4096)
    assert device(tiles=((256, 256), (256, 128))).wave_fill(shape) == 1.0
    assert device(tiles=((256, 256),)).wave_fill(shape) == pytest.approx(0.5)


def test_a_thin_gemm_is_bound_by_hbm() -> None:
    """k = 8: 2·m·n·k FLOPs are few, the m×n result is large: bytes / bandwidth."""
    d, shape = device(), GemmShape(132 * 128, 1280, 8)
    assert d.seconds(shape) == pytest.approx(shape.hbm_bytes / 3.35e12)
    assert d.seconds(shape, roofline=False) < d.seconds(shape)


def test_without_the_device_geometry_a_gemm_is_its_flops_at_one_efficiency() -> None:
    d = GemmDevice(PEAK, 0.7, 0.0, 5e-6, 3.35e12)
    shape = GemmShape(1000, 333, 77, 3)
    assert d.seconds(shape) == pytest.approx(shape.flops / (PEAK * 0.7) + 5e-6, rel=1e-12)


SCENARIO = {"parallel": {"tp": 1}, "model": {"layers": 4, "hidden": 1024, "heads": 16,
                                            "seq_len": 512, "vocab": 1000}}


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4]), st.sampled_from([8, 16]),
       st.sampled_from(["gelu", "swiglu"]), st.integers(1, 4))
def test_a_ranks_gemm_shapes_hold_its_share_of_the_layers_flops(
        tp: int, cp: int, groups: int, activation: str, mb: int) -> None:
    """Over tp (weights) and cp (tokens): each GEMM's per-rank shape holds
    1/(tp·cp) of the layer's FLOPs."""
    s = parse_scenario({"parallel": {"tp": tp, "context_parallel_size": cp},
                        "model": {**SCENARIO["model"], "num_query_groups": groups,
                                  "activation": activation, "micro_batch_size": mb,
                                  "ffn_hidden_size": 3072, "attention_backend": "flash"}})
    shapes = rank_layer_shapes(s)
    whole = dict(layer_gemms(s).items())
    for name, shape in shapes.items():
        assert shape.flops * tp * cp == pytest.approx(whole[name], rel=1e-12), name
    assert rank_logits_shape(s).flops * tp * cp == pytest.approx(logits_forward_flops(s),
                                                                 rel=1e-12)


def test_a_named_device_prices_a_layer_by_its_gemm_shapes() -> None:
    """On an H100 (132 SMs) a layer whose GEMMs fill 1.x waves takes longer
    than its FLOPs at the device's efficiency; the same layer without the
    geometry takes exactly that (unfused attention: its core is GEMMs too)."""
    model = {**SCENARIO["model"], "attention_backend": "unfused"}
    s = parse_scenario({**SCENARIO, "model": model, "cluster": {"gpu": {"device": "h100-sxm"}}})
    gpu = s.cluster.gpu.model_copy(update={"sm_count": None})
    flat = s.model_copy(update={"cluster": s.cluster.model_copy(update={"gpu": gpu})})
    eff = Efficiency.of(flat)
    gemms = layer_gemms(s).total / eff.flops_per_s
    elementwise = layer_forward_s(flat, eff) - gemms
    assert layer_forward_s(s, Efficiency.of(s)) - elementwise > gemms * 1.01


def modelled(s: Scenario) -> Scenario:
    """``s`` on the analytic GEMM model: its device's measured kernels dropped."""
    gpu = s.cluster.gpu.model_copy(update={"kernels": None})
    return s.model_copy(update={"cluster": s.cluster.model_copy(update={"gpu": gpu})})


def test_the_device_fit_recovers_the_constants_its_rows_were_made_with() -> None:
    """Two H100 rows on the analytic GEMM model (no measured kernels) timed by
    the simulator at known constants (efficiency, GEMM size at half of it, the
    A100's elementwise traffic): fitting them as published rows gives the
    constants back and reproduces both rows."""
    truth = {"cluster.gpu.efficiency": 0.62, "cluster.gpu.gemm_half_gflops": 25.0,
             "cluster.gpu.elementwise_traffic": 3.0}
    small = [modelled(r.scenario)
             for r in published_runs(ROOT) if r.source.endswith(("1.7B", "7.1B"))]
    rows = [PublishedRun(f"row {i}", s, "iteration_s",
                         replica_time(with_settings(s, truth)), True, "h100-sxm")
            for i, s in enumerate(small)]
    constants, fit = fit_generation(rows, rows[0].generation, replica_time,
                                    {A100_2021: {"elementwise_traffic": 3.0}},
                                    knobs=(TABLE1_KNOBS[0], GEMM_HALF_KNOB))
    assert constants == pytest.approx({k.split(".")[-1]: v for k, v in truth.items()}, rel=1e-2)
    assert fit.residuals == pytest.approx([0.0, 0.0], abs=1e-3)
