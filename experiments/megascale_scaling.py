"""MegaScale's strong scaling (Jiang et al. 2024, Table 2, Megatron-LM rows):
GPT 175B at batch 6144 on 3,072 and 12,288 GPUs, 29.02 s and 8.57 s per
iteration, a 3.39x speed-up for 4x the GPUs; what the simulator predicts for
the two points and their ratio, and how much each scale-dependent cost adds.

The scenarios are scenarios/published/megascale2024/ (every assumption is
written there). Each variant changes one thing of them: the inter-node
per-step latency off, and the pods' oversubscription from the paper's nominal
1:1 up. Each point is one data-parallel replica plus its data-parallel
collectives (``megatronapp predict --replica``). Last, the straggler effect
of many noisy devices in closed form: if every GPU runs at its own persistent
speed, lognormal with spread σ, a synchronous job runs at its slowest GPU's,
whose expected z-score grows with the GPU count (Blom's approximation of the
largest of n normal draws). Prints markdown.

    python -m experiments.megascale_scaling [--variants all|files]
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from statistics import NormalDist

from experiments import results
from megatronapp.fidelity.fit import with_settings
from megatronapp.fidelity.published import throughput_error
from megatronapp.scenario.config import Scenario, load_scenario
from sim import simulate_iteration_times

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "scenarios" / "published" / "megascale2024"
PUBLISHED_S = {3072: 29.02, 12288: 8.57}  # Table 2, Megatron-LM, batch 6144
VARIANTS: dict[str, dict[str, float]] = {
    "as the scenario files (pods of 64 nodes, 2:1 between pods)": {},
    "no inter-node step latency": {"cluster.links.inter_node_latency_us": 0.0},
    "pods at the paper's nominal 1:1": {"cluster.network.oversubscription": 1.0},
    "pods at 1.5:1": {"cluster.network.oversubscription": 1.5},
    "pods at 3:1": {"cluster.network.oversubscription": 3.0},
}


def point(gpus: int) -> Scenario:
    return load_scenario(SCENARIOS / f"gpus{gpus}.yaml")


def predicted_s(s: Scenario) -> float:
    return simulate_iteration_times(s, replica=True)[0]


def slowest_z(n: int) -> float:
    """Expected largest of n standard normal draws (Blom: Φ⁻¹((n − 0.375)/(n + 0.25)))."""
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def print_stragglers(target: float, base_ratio: float) -> list[dict[str, float]]:
    rows = []
    print("\n| persistent device spread σ | slowest of 3,072 | slowest of 12,288 "
          "| speed-up with it | vs published |")
    print("|---:|---:|---:|---:|---:|")
    for sigma in (0.01, 0.02, 0.05, 0.10):
        slow = {g: math.exp(sigma * slowest_z(g)) for g in PUBLISHED_S}
        ratio = base_ratio * slow[3072] / slow[12288]
        rows.append({"sigma": sigma, "slowest_3072": slow[3072], "slowest_12288": slow[12288],
                     "speedup": ratio, "vs_published": ratio / target - 1})
        print(f"| {sigma:.0%} | {slow[3072]:.3f}x | {slow[12288]:.3f}x | {ratio:.2f}x "
              f"| {(ratio / target - 1) * 100:+.1f}% |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", choices=("all", "files"), default="all",
                        help="every variant, or the scenario files alone")
    results.results_dir_option(parser)
    args = parser.parse_args(argv)
    run, rows = results.start("megascale_scaling", argv), []
    chosen = list(VARIANTS.items())[:1 if args.variants == "files" else None]
    target = PUBLISHED_S[3072] / PUBLISHED_S[12288]
    print(f"published: 3,072 GPUs {PUBLISHED_S[3072]} s, 12,288 GPUs {PUBLISHED_S[12288]} s, "
          f"speed-up {target:.2f}x\n")
    print("| variant | 3,072 GPUs (s) | error | 12,288 GPUs (s) | error | speed-up | vs published "
          "| simulation wall (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    ratios = []
    for label, settings in chosen:
        t0 = time.perf_counter()
        times = {g: predicted_s(with_settings(point(g), settings)) for g in PUBLISHED_S}
        ratio = times[3072] / times[12288]
        ratios.append(ratio)
        errors = {g: throughput_error(PUBLISHED_S[g], times[g]) * 100 for g in PUBLISHED_S}
        rows.append({"variant": label, "settings": settings, "iteration_s": times,
                     "throughput_error_pct": errors, "speedup": ratio,
                     "simulation_wall_s": time.perf_counter() - t0})
        print(f"| {label} | {times[3072]:.2f} | {errors[3072]:+.1f}% | {times[12288]:.2f} "
              f"| {errors[12288]:+.1f}% | {ratio:.2f}x | {(ratio / target - 1) * 100:+.1f}% "
              f"| {time.perf_counter() - t0:.0f} |", flush=True)
    stragglers = print_stragglers(target, ratios[0])
    recorded = run.record({"published_s": PUBLISHED_S, "published_speedup": target,
                           "variants": rows, "stragglers": stragglers}, args.results_dir)
    print(f"wrote {recorded}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
