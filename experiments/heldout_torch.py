"""Calibrated prediction of held-out torch-backend runs on this machine.

Runs a tiny GPT for real (torch backend, gloo, this machine's CPU) in the
calibration configuration (``scenarios/fidelity/cpu_tiny.yaml``: interleaved,
pp 2, vpp 2, 4 microbatches) and in held-out ones (other microbatch counts,
schedules, pipeline depths), each ``--repeats`` times, round-robin so that
load drifts hit every configuration alike. The efficiency model is calibrated
on the first run of the calibration configuration only (``megatronapp
calibrate``); every configuration is then predicted by the calibrated
simulator. A run's time is the median of its iterations after the first
(warm-up); the table shows the median over runs, the run-to-run spread
((max - min) / median over runs) and the prediction's error.

    python -m experiments.heldout_torch [--repeats 5]

Run directories go to runs/heldout/ (the calibrated scenario too).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from statistics import median

from backends.torch import run_scenario as run_torch
from experiments import results
from megatronapp.scenario.config import Scenario, load_scenario
from megatronapp.fidelity.calibrate import calibrate, load_measured
from megatronapp.fidelity.fit import with_settings
from megatronapp.run.write import write_run
from sim import simulate_iteration_times

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "fidelity" / "cpu_tiny.yaml"
SIM_ITERATIONS = 41
OUT = ROOT / "runs" / "heldout"
ONE_F_ONE_B = ["schedule=1f1b", "parallel.vpp=1"]
CONFIGS: dict[str, list[str]] = {
    "interleaved, pp 2, vpp 2, 4 mb (calibration)": [],
    "interleaved, pp 2, vpp 2, 8 mb": ["parallel.microbatches=8"],
    "1F1B, pp 2, 4 mb": ONE_F_ONE_B,
    "GPipe, pp 2, 4 mb": ["schedule=gpipe", "parallel.vpp=1"],
    "1F1B, pp 1, dp 2, 4 mb": ONE_F_ONE_B + ["parallel.pp=1", "parallel.dp=2"],
    "1F1B, pp 4, 8 mb (4 ranks, 2 cores)": ONE_F_ONE_B + ["parallel.pp=4",
                                                          "parallel.microbatches=8"],
}


def steady_s(times: list[float]) -> float:
    return median(times[1:] if len(times) > 1 else times)


def measure(repeats: int) -> dict[str, list[Path]]:
    runs: dict[str, list[Path]] = {name: [] for name in CONFIGS}
    for rep in range(repeats):
        for i, (name, sets) in enumerate(CONFIGS.items()):
            s = load_scenario(SCENARIO, sets)
            start = time.perf_counter()
            result = run_torch(s)
            out = OUT / f"config{i}" / f"run{rep}"
            out.mkdir(parents=True, exist_ok=True)
            write_run(s, result, out)
            runs[name].append(out)
            print(f"[{rep + 1}/{repeats}] {name}: {time.perf_counter() - start:.0f} s wall",
                  file=sys.stderr, flush=True)
    return runs


def run_time(run_dir: Path) -> float:
    import json

    return steady_s(json.loads((run_dir / "summary.json").read_text())["iteration_times_s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    results.results_dir_option(parser)
    args = parser.parse_args(argv)
    experiment, rows = results.start("heldout_torch", argv), []
    load_before = os.getloadavg()[0]
    runs = measure(args.repeats)
    calibration_run = runs[next(iter(CONFIGS))][0]
    cal = calibrate(load_measured(calibration_run, SCENARIO))
    print(f"calibrated on {calibration_run.relative_to(ROOT)} (load average {load_before:.1f} "
          f"before the runs, {os.getloadavg()[0]:.1f} after):")
    print("  " + ", ".join(f"{k.split('.')[-1]} = {v:.4g}" for k, v in cal.settings.items()))
    print()
    print("| configuration | measured (ms) | run-to-run spread | predicted (ms) | error |")
    print("|---|---:|---:|---:|---:|")
    errors = []
    for name, sets in CONFIGS.items():
        measured = [run_time(d) for d in runs[name]]
        mid = median(measured)
        spread = (max(measured) - min(measured)) / mid
        # the calibrated noise makes simulated iterations differ: simulate many
        s: Scenario = with_settings(load_scenario(SCENARIO, sets + [f"iterations={SIM_ITERATIONS}"]),
                                    cal.settings)
        predicted = steady_s(simulate_iteration_times(s))
        err = predicted / mid - 1
        if sets:
            errors.append(abs(err))
        rows.append({"configuration": name, "overrides": sets, "measured_s": measured,
                     "median_s": mid, "spread": spread, "predicted_s": predicted,
                     "error": err, "held_out": bool(sets)})
        print(f"| {name} | {mid * 1e3:.1f} | {spread * 100:.1f}% | {predicted * 1e3:.1f} "
              f"| {err * 100:+.1f}% |")
    print(f"\nheld-out configurations: mean |error| {sum(errors) / len(errors) * 100:.1f}%, "
          f"max {max(errors) * 100:.1f}% ({args.repeats} runs each)")
    recorded = experiment.record(
        {"repeats": args.repeats, "calibration_run": str(calibration_run.relative_to(ROOT)),
         "settings": cal.settings, "rows": rows}, args.results_dir)
    print(f"wrote {recorded}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
