"""``megatronapp calibrate`` and ``predict``: constants recovered from simulated
runs generated with them, predictions against closed forms, one-line errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatronapp.scenario.config import load_scenario, parse_scenario
from megatronapp.fidelity.fit import Knob, fit_constants, with_settings
from megatronapp.costs.flops import model_flops_per_iteration
from sim import simulate_iteration_times

from .support import CALIBRATION_TRUTH, ROOT, run_cli

CPU_TINY = ROOT / "scenarios" / "fidelity" / "cpu_tiny.yaml"
def test_calibrate_recovers_the_constants_a_simulated_run_was_made_with(tmp_path: Path) -> None:
    run_dir, out = tmp_path / "measured", tmp_path / "calibrated.yaml"
    sets = [a for k, v in CALIBRATION_TRUTH.items() for a in ("--set", f"{k}={v}")]
    proc = run_cli("run", str(CPU_TINY), "--out", str(run_dir), "--quiet", *sets)
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("calibrate", str(run_dir), "--scenario", str(CPU_TINY), "--out", str(out),
                   "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    for key, value in CALIBRATION_TRUTH.items():
        # waiting on a send's completion also shows between operations
        tolerance = 0.05 if key == "cluster.gpu.op_overhead_us" else 1e-3
        assert report["settings"][key] == pytest.approx(value, rel=tolerance), key
    assert report["settings"]["cluster.jitter.compute_sigma"] == 0.0  # a noiseless run
    calibrated = load_scenario(out)
    assert calibrated.cluster.gpu.efficiency == pytest.approx(0.3, rel=1e-3)
    assert report["simulated_iteration_s"] == pytest.approx(report["measured_iteration_s"],
                                                            rel=0.01)


def test_fit_recovers_efficiency_and_elementwise_traffic_from_two_runs() -> None:
    truth = {"cluster.gpu.efficiency": 0.45, "cluster.gpu.elementwise_traffic": 2.5}
    base = {"parallel": {"tp": 2, "microbatches": 2}, "cluster": {"gpu": {"hbm_tbps": 2.0}},
            "model": {"layers": 4, "hidden": 2048, "heads": 16, "seq_len": 2048, "vocab": 1024}}
    small = parse_scenario(base)
    large = parse_scenario({**base, "model": {**base["model"], "hidden": 8192, "heads": 64}})

    def time_of(s):
        return simulate_iteration_times(s)[0]

    targets = [(s, time_of(with_settings(s, truth))) for s in (small, large)]
    knobs = (Knob("cluster.gpu.efficiency", 0.7, 0.05, 1.0),
             Knob("cluster.gpu.elementwise_traffic", 0.5, 0.0, 20.0))
    fit = fit_constants(targets, knobs, time_of)
    for key, value in truth.items():
        assert fit.values[key] == pytest.approx(value, rel=1e-3)


def test_a_gauss_newton_step_that_overshoots_is_halved_until_the_fit_improves() -> None:
    """Time ∝ 1/efficiency, fitted from 0.7 to 0.3: the full first step lands
    below the lower bound (error +500%); halved, every step improves."""
    s = parse_scenario({})
    reported: list[str] = []
    fit = fit_constants([(s, 1 / 0.3)], [Knob("cluster.gpu.efficiency", 0.7, 0.05, 1.0)],
                        lambda q: 1 / q.cluster.gpu.efficiency, steps=8, progress=reported.append)
    max_errors = [float(m.rsplit(" ", 1)[1].rstrip("%")) for m in reported]
    assert max_errors == sorted(max_errors, reverse=True)
    assert fit.values["cluster.gpu.efficiency"] == pytest.approx(0.3, rel=1e-3)


def test_predict_reports_a_closed_form_iteration_and_the_model_flops(tmp_path: Path) -> None:
    p, m, b, seq, h, layers, v = 4, 8, 1, 512, 256, 8, 1000
    data = {"name": "closed", "schedule": "1f1b", "parallel": {"pp": p, "microbatches": m},
            "model": {"layers": layers, "hidden": h, "heads": 4, "seq_len": seq, "vocab": v},
            "costs": {"forward_s": 1.0, "backward_s": 2.0, "p2p_s": 0, "allreduce_s": 0,
                      "optimizer_s": 0}}
    path = tmp_path / "closed.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = run_cli("predict", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["iteration_s"] == pytest.approx((m + p - 1) * 3.0, rel=1e-12)
    # Narayanan et al. without recomputation: 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)),
    # V the vocabulary Megatron pads to a multiple of 128: 1,024
    flops = 72 * m * b * seq * layers * h * h * (1 + seq / (6 * h) + 1024 / (12 * layers * h))
    assert out["model_flops_per_iteration"] == pytest.approx(flops, rel=1e-12)
    assert out["mfu"] == pytest.approx(flops / p / out["iteration_s"] / 400e12, rel=1e-12)
    assert [r["pp_rank"] for r in out["memory_per_rank"]] == list(range(p))
    assert model_flops_per_iteration(parse_scenario(data)) == pytest.approx(flops, rel=1e-12)


def test_predict_replica_refuses_a_scenario_whose_replicas_differ() -> None:
    proc = run_cli("predict", "scenarios/throttle.yaml", "--replica")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "--replica" in line and "faults or jitter" in line


def test_predict_names_the_option_that_would_make_gpt3_fit() -> None:
    proc = run_cli("predict", "scenarios/gpt3_175b.yaml", "--set", "parallel.sequence_parallel=false",
                   "--set", "training.recompute=none", "--set",
                   "training.distributed_optimizer=false", "--set",
                   "training.overlap_param_gather=false")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "cluster.gpu.memory_gb" in line and "training.recompute: full" in line
    assert "does not fit" in proc.stdout and "activations" in proc.stdout


def test_calibrate_without_a_trace_is_a_one_line_error(tmp_path: Path) -> None:
    proc = run_cli("calibrate", str(tmp_path / "nothing"), "--scenario", str(CPU_TINY))
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "measured" in line and "not found" in line


def test_calibrate_measures_the_noise_of_a_jittered_run() -> None:
    from sim import run_sim
    from megatronapp.fidelity.calibrate import Measured, calibrate

    s = load_scenario(CPU_TINY, ["iterations=12", "cluster.jitter.compute_sigma=0.2"])
    cal = calibrate(Measured(s, run_sim(s).events))
    assert cal.settings["cluster.jitter.compute_sigma"] == pytest.approx(0.2, rel=0.15)


def test_gpt3_175b_runs_and_fits() -> None:
    proc = run_cli("predict", "scenarios/gpt3_175b.yaml", "--replica", "--json",
                   "--set", "parallel.microbatches=8")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["iteration_s"] > 0 and 0 < out["mfu"] < 1
    assert out["peak_memory_bytes"] < out["memory_capacity_bytes"] == 80e9
