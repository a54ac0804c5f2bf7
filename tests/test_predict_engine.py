"""``megatronapp predict`` simulates on the compiled engine (as ``run`` does) and
reports the iteration times ``run``'s summary reports for the same scenario."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatronapp.cli import main

from .support import ROOT, run_cli

NO_JITTER = "cluster.jitter={compute_sigma: 0, link_sigma: 0}"
SCENARIOS = [
    ("throttle.yaml", []),  # a throttled rank, clock skew, compute and link jitter
    ("dpp_slow_link.yaml", ["schedule=1f1b", "parallel.vpp=1"]),  # a slow link, jitter
    ("dpp_throttled_stage.yaml", ["schedule=interleaved"]),  # a throttled stage, vpp 2
    ("throttle.yaml", ["faults=[]", NO_JITTER]),  # healthy: one class of pipelines
]


def _json_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _sets(sets: list[str]) -> list[str]:
    return [arg for value in sets for arg in ("--set", value)]


@pytest.mark.parametrize("name, sets", SCENARIOS)
def test_predict_reports_the_iteration_times_of_run(name: str, sets: list[str], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    scenario = str(ROOT / "scenarios" / name)
    ran = _json_of(["run", scenario, "--out", str(tmp_path / "run"), "--quiet", "--json",
                    *_sets(sets)], capsys)
    predicted = _json_of(["predict", scenario, "--quiet", "--json", *_sets(sets)], capsys)
    assert predicted["iteration_times_s"] == ran["iteration_times_s"]
    assert len(ran["iteration_times_s"]) > 1


def test_predict_does_not_run_the_simpy_interpreter(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from megatronapp.scenario.config import load_scenario
    from sim.interpreter import SimInterpreter

    def refuse(*_args: object, **_kw: object) -> None:
        raise AssertionError("predict ran the SimPy interpreter")

    monkeypatch.setattr(SimInterpreter, "__init__", refuse)
    scenario = ROOT / "scenarios" / "throttle.yaml"
    predicted = _json_of(["predict", str(scenario), "--quiet", "--json"], capsys)
    assert len(predicted["iteration_times_s"]) == load_scenario(str(scenario), []).iterations


def test_predict_on_an_adaptive_schedule_says_memory_is_not_predicted() -> None:
    """An adaptive schedule orders its work at run time: no static order to
    size, so no peak is claimed (it was a ValueError traceback)."""
    result = run_cli("predict", str(ROOT / "scenarios" / "dpp_healthy.yaml"), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["peak_memory_bytes"] is None
    text = run_cli("predict", str(ROOT / "scenarios" / "dpp_healthy.yaml")).stdout
    assert "memory per rank: not predicted" in text


def test_figures_of_a_cpu_sized_model_are_not_printed_as_zero() -> None:
    from megatronapp.fidelity.predict import Prediction, prediction_lines

    tiny = Prediction(name="tiny", gpus=2, peak_flops_per_gpu=400e12,
                      iteration_times_s=(2e-4, 1.2e-4), model_flops=8e4, hardware_flops=1e5,
                      memory=(), capacity_bytes=80e9, notes=(), replica=False)
    text = "\n".join(prediction_lines(tiny))
    assert "iteration time: 0.00012 s" in text
    throughput = tiny.hardware_tflops_per_gpu
    assert 0 < throughput < 0.05 and f"throughput: {throughput:.3g} TFLOP/s" in text
    assert "0.0 TFLOP/s" not in text and "MFU 0.0%" not in text


def test_one_iteration_says_the_overlapped_weight_gather_is_left_out(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The note is true: the steady state (iterations 2) carries the gathers and is slower."""
    scenario = str(ROOT / "scenarios/published/megatron_h100/32b.yaml")
    one = _json_of(["predict", scenario, "--replica", "--json", "--set", "iterations=1"], capsys)
    two = _json_of(["predict", scenario, "--replica", "--json", "--set", "iterations=2"], capsys)
    assert any("overlap_param_gather" in n and "iterations: 2" in n for n in one["notes"])
    assert not any("overlap_param_gather" in n for n in two["notes"])
    assert two["iteration_s"] > one["iteration_s"]
    without = _json_of(["predict", scenario, "--replica", "--json", "--set", "iterations=1",
                        "--set", "training.overlap_param_gather=false"], capsys)
    assert not any("overlap_param_gather" in n for n in without["notes"])
