"""The straggler effect of many slightly different devices: a synchronous step
waits for the slowest, so the same per-device spread costs more with more
devices (the expected maximum of that many draws).

    python -m experiments.straggler_scale [--gpus 1024,12288,98304] [--sigma 0.05] [--seeds 3]

Each job: tp 8, pp 1, dp = GPUs / 8, one microbatch of fixed costs (a forward
of 0.1 s, a backward of 0.2 s, an all-reduce of 0.05 s, an optimizer step of
0.01 s), one iteration, every device's compute time a seeded lognormal draw
(``device_variation``, median 1, ``sigma``). Simulated on the compiled engine,
nothing reduced (every device differs), each in a child process of its own
(its CPU time and peak memory). The step's slowdown, (T - T_healthy) /
compute + 1, against the slowest draw and the expected maximum of that many
draws, E[exp(sigma x max of n standard normals)].
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from typing import Any

import numpy as np

from experiments import results
from experiments.render import markdown_table

NAME = "straggler_scale"
COSTS = {"forward_s": 0.1, "backward_s": 0.2, "allreduce_s": 0.05, "optimizer_s": 0.01,
         "p2p_s": 0.0}
COMPUTE_S = 0.1 + 0.2 + 0.01  # what the slowest device stretches (after the all-reduce, its step)


def scenario(gpus: int, sigma: float, seed: int) -> dict[str, Any]:
    faults = [{"kind": "device_variation", "sigma": sigma}] if sigma > 0 else []
    return {"name": f"spread{gpus}", "seed": seed, "iterations": 1, "schedule": "1f1b",
            "parallel": {"tp": 8, "pp": 1, "dp": gpus // 8, "microbatches": 1},
            "model": {"layers": 2, "hidden": 1024, "heads": 16, "seq_len": 1024},
            "costs": COSTS, "faults": faults}


def simulate_one(gpus: int, sigma: float, seed: int) -> dict[str, Any]:
    """One job simulated here (the child's side): its step and its cost."""
    from megatronapp.faults import DeviceVariation
    from megatronapp.scenario.config import fault_job, parse_scenario
    from megatronapp.trace.summary import run_iteration_times
    from sim import run_sim

    s = parse_scenario(scenario(gpus, sigma, seed))
    cpu, wall = time.process_time(), time.perf_counter()
    step = run_iteration_times(run_sim(s))[0]
    out = {"gpus": gpus, "sigma": sigma, "seed": seed, "step_s": step,
           "cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall,
           "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}
    if sigma > 0:  # the draws the job ran with (the same seed, the same stream)
        spread = DeviceVariation(kind="device_variation", sigma=sigma)
        out["max_factor"] = float(spread.factors(fault_job(s)).max())
    return out


def in_child(gpus: int, sigma: float, seed: int) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", f"experiments.{NAME}", "--one",
                           f"{gpus},{sigma},{seed}"], capture_output=True, text=True, check=True)
    found: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return found


def expected_max_factor(n: int, sigma: float) -> float:
    """E[exp(sigma Z_max)] for the maximum of n standard normals (numerically)."""
    z = np.linspace(-8.0, 9.0, 200001)
    log_cdf = np.log(0.5 * np.vectorize(math.erfc)(-z / math.sqrt(2.0)))
    density = n * np.exp(-z * z / 2.0) / math.sqrt(2.0 * math.pi) * np.exp((n - 1) * log_cdf)
    return float(np.trapezoid(np.exp(sigma * z) * density, z))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", default="1024,4096,12288,49152,98304")
    parser.add_argument("--sigma", type=float, default=0.05)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # GPUS,SIGMA,SEED: one job, JSON out
    args = parser.parse_args(argv)
    if args.one:
        gpus, sigma, seed = args.one.split(",")
        print(json.dumps(simulate_one(int(gpus), float(sigma), int(seed))))
        return
    run = results.start(NAME, argv)
    rows = []
    for gpus in (int(g) for g in args.gpus.split(",")):
        healthy = in_child(gpus, 0.0, 0)
        for seed in range(args.seeds):
            print(f"{gpus} GPUs, seed {seed}", flush=True)
            varied = in_child(gpus, args.sigma, seed)
            rows.append({**varied, "healthy_step_s": healthy["step_s"],
                         "slowdown": (varied["step_s"] - healthy["step_s"]) / COMPUTE_S + 1.0,
                         "expected_max_factor": expected_max_factor(gpus, args.sigma)})
    print(run.record({"sigma": args.sigma, "compute_s": COMPUTE_S, "rows": rows}))


def tables(doc: dict[str, Any]) -> dict[str, str]:
    data = doc["data"]
    by_gpus: dict[int, list[dict[str, Any]]] = {}
    for r in data["rows"]:
        by_gpus.setdefault(r["gpus"], []).append(r)
    rows = []
    for gpus, runs in sorted(by_gpus.items()):
        rows.append([f"{gpus:,}", len(runs),
                     f"{runs[0]['healthy_step_s']:.4f}",
                     f"{np.mean([r['step_s'] for r in runs]):.4f}",
                     " / ".join(f"{r['slowdown']:.4f}" for r in runs),
                     " / ".join(f"{r['max_factor']:.4f}" for r in runs),
                     f"{runs[0]['expected_max_factor']:.4f}",
                     f"{max(r['cpu_s'] for r in runs):.1f}",
                     f"{max(r['peak_rss_gb'] for r in runs):.2f}"])
    return {"scale": markdown_table(
        ["GPUs", "seeds", "healthy step (s)", f"step, sigma {data['sigma']:g} (s)",
         "slowdown per seed", "slowest draw per seed", "expected slowest",
         "CPU s (worst)", "peak GB (worst)"], rows, "lrrrrrrrr")}


if __name__ == "__main__":
    main()
