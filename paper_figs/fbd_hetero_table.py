"""MegaFBD on heterogeneous clusters: per-device throughput and peak memory of
the decoupled job against co-located Megatron, from scenarios/fbd_hetero.yaml.

    .venv/bin/python paper_figs/fbd_hetero_table.py [--scenario FILE]

Each block is one cluster (the slow class's speed and memory varied with
overrides); "vs base" compares average useful TFLOPS per device with
co-located Megatron on the same devices.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.progress import track  # noqa: E402

from megatronapp.scenario.config import load_scenario  # noqa: E402
from megatronapp.fbd.hetero import format_table  # noqa: E402
from sim.fbd import compare_plans  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="scenarios/fbd_hetero.yaml")
    args = parser.parse_args()
    rows = [(label, compare_plans(load_scenario(args.scenario, overrides)))
            for label, overrides in track(list(CLUSTERS.items()), description="simulating",
                                          transient=True)]
    print(format_table(rows))


if __name__ == "__main__":
    main()
