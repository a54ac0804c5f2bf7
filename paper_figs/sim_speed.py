"""Simulator speed: operations/s against a bare SimPy loop (same run), the
wall time to simulate one iteration of a 1024-GPU job (tp 8, pp 8, dp 16, 32 mb),
and the same jobs with overlapped gradient reduction (asynchronous collectives),
the 64-GPU one on the compiled engine and on the SimPy generator path.

    .venv/bin/python paper_figs/sim_speed.py
"""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks' speed helpers

from megatronapp.scenario.config import parse_scenario  # noqa: E402
from sim import bare_simpy_events_per_s, run_sim  # noqa: E402
from tests.benchmarks.speed import JOB_1024, job_1024, simulate_speed  # noqa: E402

SMALL = {**JOB_1024, "name": "gpt-64gpu", "parallel": {"tp": 2, "pp": 4, "dp": 8, "microbatches": 16}}


def overlapped(job: dict[str, Any]) -> dict[str, Any]:
    return {**job, "training": {"overlap_grad_reduce": True}}


def main() -> None:
    bare = bare_simpy_events_per_s()
    small = simulate_speed(parse_scenario(SMALL), run_sim)
    big = simulate_speed(job_1024(), run_sim)
    print("| measurement | value |")
    print("|---|---|")
    print(f"| bare SimPy loop | {bare / 1e3:.0f} k timeouts/s |")
    print(f"| simulator, 64 GPUs (tp2 pp4 dp8, 16 mb) | {small.ops_per_s / 1e3:.1f} k ops/s |")
    print(f"| simulator, 1024 GPUs (tp8 pp8 dp16, 32 mb) | {big.ops_per_s / 1e3:.1f} k ops/s |")
    print(f"| ratio simulator / bare loop (1024 GPUs) | {big.ops_per_s / bare:.3f} |")
    print(f"| one iteration of the 1024-GPU job | {big.wall_s:.2f} s wall, {big.ops} ops |")
    small_o = parse_scenario(overlapped(SMALL))
    compiled = simulate_speed(small_o, run_sim)
    generator = simulate_speed(small_o, partial(run_sim, engine="generator"))
    big_o = simulate_speed(parse_scenario(overlapped(JOB_1024)), run_sim)
    print(f"| 64 GPUs, overlapped gradient reduction, compiled engine | "
          f"{compiled.ops_per_s / 1e3:.1f} k ops/s |")
    print(f"| the same job on the SimPy generator path | {generator.ops_per_s / 1e3:.1f} k ops/s "
          f"({compiled.ops_per_s / generator.ops_per_s:.0f}x slower) |")
    print(f"| one iteration of the 1024-GPU job, overlapped gradient reduction | "
          f"{big_o.wall_s:.2f} s wall, {big_o.ops} ops |")


if __name__ == "__main__":
    main()
