"""Kernels measured on a device (``cluster.gpu.kernels``): the shapes
experiments/kernel_bench.py lists are the ones the cost model prices, the
table prices them as measured (GEMMs in Megatron's layout, fused attention
as cuDNN's, flash as FlashAttention-2's, element-wise work at its measured
bandwidth), interpolates between measured shapes in log space, and
``kernel_time_factor`` scales every measured kernel; kernel_bench.py's fit of
the analytic GEMM model gives back the constants of GEMMs it timed itself."""
from __future__ import annotations

import json
from statistics import harmonic_mean
from typing import Any

import pytest

from megatronapp.costs.gemm import GemmDevice, GemmShape
from megatronapp.costs.kernels import KernelTable, LogTable, attention_shape, load_kernel_table
from megatronapp.costs.per_op import (Efficiency, layer_forward_s, rank_gemm_s, scores_rebuild_s,
                                      stage_costs)
from megatronapp.fidelity.fit import with_settings
from megatronapp.fidelity.published import published_runs
from megatronapp.scenario.config import Scenario, ScenarioError, parse_scenario
from megatronapp.scenario.devices import DEVICES, KERNELS_DIR
from experiments.kernel_bench import MODEL_TILES, fit_gemm_model, kernel_shapes, time_ratios

from .support import ROOT, run_cli

MEASURED = json.loads((KERNELS_DIR / "h100-sxm.json").read_text())
ON_TABLE = {"cluster.gpu.kernels": "h100-sxm"}


def readme_row(name: str) -> Scenario:
    return next(r.scenario for r in published_runs(ROOT)
                if r.source.endswith(f"on H100, {name}"))


def test_the_shapes_listed_are_the_shapes_the_cost_model_prices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every published row on the measured table: the GEMMs and attention cores
    its stage costs look up equal the shapes mode's forward GEMMs and attention
    shapes, and the stored measurement holds every shape of the rows it prices."""
    runs = published_runs(ROOT)
    priced_gemms: set[tuple[int, int, int]] = set()
    priced_attention: set[tuple[int, ...]] = set()
    gemm_s, attention_s = KernelTable.gemm_s, KernelTable.attention_s

    def record_gemm(self: KernelTable, shape: GemmShape) -> float:
        priced_gemms.add((shape.m, shape.n, shape.k))
        return gemm_s(self, shape)

    def record_attention(self: KernelTable, backend: str, shape: Any, flops: float) -> Any:
        priced_attention.add(shape.key)
        return attention_s(self, backend, shape, flops)

    monkeypatch.setattr(KernelTable, "gemm_s", record_gemm)
    monkeypatch.setattr(KernelTable, "attention_s", record_attention)
    for r in runs:
        s = with_settings(r.scenario, {**ON_TABLE, "model.attention_backend": "fused"})
        stage_costs(s)
    listed = kernel_shapes(runs)
    forward = {(g["m"], g["n"], g["k"]) for g in listed["gemms"]
               if any(u.endswith("|fwd") for u in g["uses"])}
    attention = {(a["b"] * a["h"], a["sq"], a["sk"], a["d"]) for a in listed["attention"]}
    assert priced_gemms == forward
    assert priced_attention == attention
    # the rows priced from the table (a device with measured kernels) find every
    # shape there; the others' shapes were measured to check the analytic model
    on_table = kernel_shapes([r for r in runs if DEVICES[r.device].gpu.get("kernels")])
    assert {(g["m"], g["n"], g["k"]) for g in on_table["gemms"]} <= {
        (g["m"], g["n"], g["k"]) for g in MEASURED["gemms"]}
    assert {(a["b"] * a["h"], a["sq"], a["sk"], a["d"]) for a in on_table["attention"]} <= {
        (a["b"] * a["h"], a["sq"], a["sk"], a["d"]) for a in MEASURED["attention"]}


def test_a_measured_gemm_is_priced_as_measured_in_megatrons_layout() -> None:
    eff = Efficiency.of(readme_row("32B"))
    for g in MEASURED["gemms"][::37]:
        assert eff.shape_s(GemmShape(g["m"], g["n"], g["k"])) == pytest.approx(
            eff.kernel_time_factor * g["s_bT"], rel=1e-12)


def test_between_measured_shapes_the_rate_is_interpolated_in_log_space() -> None:
    """Two points: at either, its value; at their geometric midpoint, equal
    weights; anywhere, between the two."""
    table = LogTable(((1024, 1024, 1024), (4096, 4096, 4096)), (100.0, 300.0))
    assert table((4096, 4096, 4096)) == 300.0
    assert table((2048, 2048, 2048)) == pytest.approx(200.0, rel=1e-12)
    assert 100.0 < table((1500, 3000, 2000)) < 300.0


def measured_attention(kernel: str, s: Scenario) -> dict[str, Any]:
    key = attention_shape(s).key
    return next(a for a in MEASURED["attention"] if a["backend"] == kernel
                and (a["b"] * a["h"], a["sq"], a["sk"], a["d"]) == key)


@pytest.mark.parametrize("backend, kernel", [("fused", "cudnn"), ("flash", "flash")])
def test_attention_runs_at_its_kernels_measured_forward_and_backward(
        backend: str, kernel: str) -> None:
    """A causal core: forward as measured; backward is the measured backward,
    of which ``backward_ratio`` × forward is charged with the layer and the
    rest as the rebuild."""
    s = with_settings(readme_row("32B"), {"model.attention_backend": backend})
    eff, a = Efficiency.of(s), measured_attention(kernel, s)
    gemms, factor = rank_gemm_s(s, eff), eff.kernel_time_factor
    assert gemms["scores"] + gemms["attend"] == pytest.approx(factor * a["fwd_s"], rel=1e-12)
    assert (eff.backward_ratio * factor * a["fwd_s"] + scores_rebuild_s(s, eff)) == \
        pytest.approx(factor * (a["fwd_bwd_s"] - a["fwd_s"]), rel=1e-12)


def test_a_flash_rate_the_scenario_sets_wins_over_the_measured_kernel() -> None:
    s = with_settings(readme_row("32B"), {"model.attention_backend": "flash",
                                           "cluster.gpu.flash_attention_efficiency": 0.5})
    gemms = rank_gemm_s(s, Efficiency.of(s))
    core_flops = GemmShape(*(4096, 4096, 128), 7).flops  # causal half of QKᵀ and A·V
    assert gemms["scores"] + gemms["attend"] == pytest.approx(
        core_flops / (989e12 * 0.5), rel=1e-12)


def test_elementwise_work_moves_at_the_measured_bandwidth() -> None:
    eff = Efficiency.of(readme_row("32B"))
    bandwidth = harmonic_mean([e["gbps_nominal"] * 1e9 for e in MEASURED["elementwise"]])
    assert eff.memory_s(1e9) == pytest.approx(
        eff.kernel_time_factor * eff.elementwise_traffic * 1e9 / bandwidth, rel=1e-12)


def test_the_kernel_time_factor_scales_every_measured_kernel() -> None:
    quiet = {"cluster.gpu.module_overhead_us": 0.0}
    s = with_settings(readme_row("32B"), {**quiet, "cluster.gpu.kernel_time_factor": 1.0})
    slow = with_settings(s, {"cluster.gpu.kernel_time_factor": 1.5})
    assert layer_forward_s(slow, Efficiency.of(slow)) == pytest.approx(
        1.5 * layer_forward_s(s, Efficiency.of(s)), rel=1e-12)
    assert scores_rebuild_s(slow, Efficiency.of(slow)) == pytest.approx(
        1.5 * scores_rebuild_s(s, Efficiency.of(s)), rel=1e-12)


def test_each_hopper_device_reads_its_own_table_and_the_a100_has_none() -> None:
    assert (DEVICES["h100-sxm"].gpu["kernels"], DEVICES["h200"].gpu["kernels"]) == (
        "h100-sxm", "h200-sxm")
    assert "kernels" not in DEVICES["a100-80gb"].gpu
    assert load_kernel_table("h100-sxm") is load_kernel_table("h100-sxm")
    # no published H200 row to fit on: it takes the H100's fit (the same SMs)
    assert DEVICES["h200"].fitted == DEVICES["h100-sxm"].fitted != {}


def test_the_h200_moves_element_wise_work_at_its_own_measured_bandwidth() -> None:
    """The same row on an H200: element-wise work at the H200's measured
    bandwidth (its HBM3e), faster than on the H100 by what was measured."""
    h100 = readme_row("32B")
    h200 = with_settings(h100, {"cluster.gpu.kernels": DEVICES["h200"].gpu["kernels"]})
    measured = {name: harmonic_mean([e["gbps_nominal"] for e in json.loads(
        (KERNELS_DIR / f"{name}.json").read_text())["elementwise"]])
        for name in ("h100-sxm", "h200-sxm")}
    ratio = Efficiency.of(h100).memory_s(1e9) / Efficiency.of(h200).memory_s(1e9)
    assert ratio == pytest.approx(measured["h200-sxm"] / measured["h100-sxm"], rel=1e-9)
    assert ratio > 1.1


SMALL: dict[str, Any] = {
    "parallel": {"tp": 2, "pp": 1, "dp": 1, "microbatches": 2},
    "model": {"layers": 2, "hidden": 1024, "heads": 8, "seq_len": 512, "vocab": 4096},
}


@pytest.mark.parametrize("key, value", [("kernels", "a100"), ("kernels", 3),
                                        ("kernel_time_factor", 0), ("kernel_time_factor", "x")])
def test_a_bad_kernel_setting_is_refused_naming_the_field(key: str, value: Any,
                                                          tmp_path: Any) -> None:
    data = {**SMALL, "cluster": {"gpu": {key: value}}}
    with pytest.raises(ScenarioError) as err:
        parse_scenario(data)
    assert err.value.field == f"cluster.gpu.{key}"
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    result = run_cli("predict", str(path))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and f"cluster.gpu.{key}" in result.stderr



@pytest.mark.parametrize("tiles", [None, MODEL_TILES])
def test_the_gemm_model_fitted_on_kernels_it_timed_itself_gives_its_constants_back(
        tiles: Any) -> None:
    truth = GemmDevice(989e12, 0.68, 5e9, 0.0, 3.35e12, 132 if tiles else None,
                       tiles or ((256, 128),))
    timed = [{"m": g["m"], "n": g["n"], "k": g["k"],
              "s_bT": truth.seconds(GemmShape(g["m"], g["n"], g["k"]))}
             for g in MEASURED["gemms"][::5]]
    fitted, residuals = fit_gemm_model(timed, 989e12, 3.35e12, 132, tiles)
    assert (fitted.efficiency, fitted.half_flops) == pytest.approx((0.68, 5e9), rel=1e-9)
    assert residuals == pytest.approx([0.0] * len(timed), abs=1e-9)


def test_kernel_bench_replaces_an_existing_out_only_with_force_and_reads_tables_in_one_line(
        tmp_path: Any) -> None:
    import os
    import subprocess
    import sys

    def bench(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "experiments.kernel_bench", *args],
                              capture_output=True, text=True, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})

    out = tmp_path / "shapes.json"
    out.write_text("a user's file")
    refused = bench("shapes", "--out", str(out))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "--out" in refused.stderr
    assert out.read_text() == "a user's file"
    assert bench("shapes", "--out", str(out), "--force").returncode == 0
    assert len(json.loads(out.read_text())["gemms"]) == len(kernel_shapes(published_runs(ROOT))["gemms"])
    (tmp_path / "bad.json").write_text("not json")
    bad = bench("compare", "--table", str(tmp_path / "bad.json"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--table" in bad.stderr
    (tmp_path / "list.json").write_text("[]")
    bad = bench("versus", "--other", str(tmp_path / "list.json"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--other" in bad.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "list.json", "shapes.json"]


def test_versus_compares_the_kernels_both_tables_hold_time_for_time() -> None:
    """The other table's time over this one's, matched kernel by kernel:
    twice as slow GEMMs, the same attention, one element-wise op faster
    and one only in the other table (left out)."""
    other = {"gemms": [{**g, "s_bT": 2 * g["s_bT"]} for g in MEASURED["gemms"][:7]],
             "attention": MEASURED["attention"][:3],
             "elementwise": [{**MEASURED["elementwise"][0], "s": MEASURED["elementwise"][0]["s"] / 4},
                             {**MEASURED["elementwise"][0], "op": "softmax"}]}
    ratios = time_ratios(MEASURED, other)
    assert ratios == {"gemms": [pytest.approx(2.0)] * 7, "attention": [pytest.approx(1.0)] * 3,
                      "elementwise": [pytest.approx(0.25)]}
