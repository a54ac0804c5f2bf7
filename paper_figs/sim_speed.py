"""Simulator speed: operations/s against a bare SimPy loop (same run), and the
wall time to simulate one iteration of a 1024-GPU job (tp 8, pp 8, dp 16, 32 mb).

    .venv/bin/python paper_figs/sim_speed.py
"""
from __future__ import annotations

from backends.sim import run_sim
from megatronapp.config import parse_scenario
from megatronapp.speed import JOB_1024, bare_simpy_events_per_s, job_1024, simulate_speed

SMALL = {**JOB_1024, "name": "gpt-64gpu", "parallel": {"tp": 2, "pp": 4, "dp": 8, "microbatches": 16}}


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


if __name__ == "__main__":
    main()
