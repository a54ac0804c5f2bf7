"""MegaDPP window table: iteration time, P2P send and all-reduce windows,
bandwidth demand and peak memory for 1F1B, interleaved, DFC, BFC and adaptive
over four simulated scenarios, then the ratios the slides quote.

    .venv/bin/python -m experiments.dpp_window_table [--memory-gb 80]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from experiments import results
from megatronapp.scenario.config import read_scenario_data
from megatronapp.dpp.cli import COMPARED, compare, format_table

SCENARIOS = ("dpp_healthy", "dpp_link_jitter", "dpp_slow_link", "dpp_throttled_stage")
BASELINE = "interleaved"  # Megatron's schedule, the slides' "Original"


def gains(rows: dict, schedule: str) -> str:
    base, row = rows[BASELINE], rows[schedule]
    if isinstance(row, str) or isinstance(base, str):
        return f"  {schedule} vs {BASELINE}: n/a ({schedule} does not fit)"

    def pct(key: str) -> float:
        return (row[key] / base[key] - 1) * 100

    return (f"  {schedule} vs {BASELINE}: P2P send window {pct('p2p_send_window_ms'):+.0f}%, "
            f"all-reduce window {pct('allreduce_window_ms'):+.0f}%, "
            f"bandwidth demand {pct('p2p_bandwidth_demand_gbps'):+.0f}%, "
            f"iteration time {pct('iteration_ms'):+.1f}%")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-gb", type=float, default=80.0, help="GPU memory (default 80)")
    results.results_dir_option(parser)
    args = parser.parse_args(argv)
    run, tables = results.start("dpp_window_table", argv), {}
    root = Path(__file__).resolve().parents[1] / "scenarios"
    for name in SCENARIOS:
        data = read_scenario_data(root / f"{name}.yaml")
        data["name"] = name
        rows = compare(data, COMPARED, [f"cluster.gpu.memory_gb={args.memory_gb}"], progress=True)
        tables[name] = rows
        print(format_table(rows, f"{name} ({args.memory_gb:g} GB per GPU)"))
        for schedule in ("bfc", "adaptive"):
            print(gains(rows, schedule))
        print()
    recorded = run.record({"memory_gb": args.memory_gb, "scenarios": tables}, args.results_dir)
    print(f"wrote {recorded}")


if __name__ == "__main__":
    main()
