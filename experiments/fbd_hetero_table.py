"""MegaFBD on heterogeneous clusters: per-device throughput and peak memory of
the decoupled job against co-located Megatron, from scenarios/fbd_hetero.yaml.

    .venv/bin/python -m experiments.fbd_hetero_table [--scenario FILE]

Each block is one cluster (the slow class's speed and memory varied with
overrides); "vs base" compares average useful TFLOPS per device with
co-located Megatron on the same devices.
"""
from __future__ import annotations

import argparse
from typing import Any, Sequence

from rich.progress import track

from experiments import results
from megatronapp.scenario.config import load_scenario
from megatronapp.fbd.hetero import PlanResult, format_table
from sim.fbd import compare_plans

CLUSTERS = {  # label -> overrides of the slow class (device_classes[1])
    "homogeneous 400/400": ["cluster.device_classes.1.tflops=400",
                            "cluster.device_classes.1.memory_gb=80"],
    "slow 200 TF, 32 GB": ["cluster.device_classes.1.tflops=200"],
    "slow 133 TF, 32 GB": ["cluster.device_classes.1.tflops=133"],
    "slow 100 TF, 32 GB": ["cluster.device_classes.1.tflops=100"],
    "slow 50 TF, 32 GB": ["cluster.device_classes.1.tflops=50"],
    "slow 133 TF, fast 48 GB": ["cluster.device_classes.1.tflops=133",
                                "cluster.device_classes.0.memory_gb=48"],
}


def recorded_rows(rows: Sequence[tuple[str, Sequence[PlanResult]]]) -> list[dict[str, Any]]:
    """The printed table's rows, one per cluster and plan, as data."""
    return [{"cluster": cluster, "plan": plan.name, "iteration_s": plan.iteration_s,
             "flops_per_device": plan.flops_per_device, "fits": plan.fits,
             "peak_bytes_by_class": plan.peak_by_class()}
            for cluster, plans in rows for plan in plans]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="scenarios/fbd_hetero.yaml")
    results.results_dir_option(parser)
    args = parser.parse_args(argv)
    run = results.start("fbd_hetero_table", argv)
    rows = [(label, compare_plans(load_scenario(args.scenario, overrides)))
            for label, overrides in track(list(CLUSTERS.items()), description="simulating",
                                          transient=True)]
    print(format_table(rows))
    recorded = run.record({"scenario": args.scenario, "clusters": CLUSTERS,
                           "rows": recorded_rows(rows)}, args.results_dir)
    print(f"wrote {recorded}")


if __name__ == "__main__":
    main()
