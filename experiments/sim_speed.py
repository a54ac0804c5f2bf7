"""Simulator speed: operations/s against a bare SimPy loop (same run), the
wall time to simulate one iteration of a 1024-GPU job (tp 8, pp 8, dp 16, 32 mb),
and the same jobs with overlapped gradient reduction (asynchronous collectives),
the 64-GPU one on the compiled engine and on the SimPy generator path.

    .venv/bin/python -m experiments.sim_speed
"""
from __future__ import annotations

from functools import partial
from typing import Any

from experiments import results
from megatronapp.scenario.config import parse_scenario
from sim import bare_simpy_events_per_s, run_sim
from tests.benchmarks.speed import JOB_1024, job_1024, simulate_speed

SMALL = {**JOB_1024, "name": "gpt-64gpu", "parallel": {"tp": 2, "pp": 4, "dp": 8, "microbatches": 16}}


def overlapped(job: dict[str, Any]) -> dict[str, Any]:
    return {**job, "training": {"overlap_grad_reduce": True}}


def main(argv: list[str] | None = None) -> None:
    options = results.parser("sim_speed", __doc__)
    results.results_dir_option(options)
    args = options.parse_args(argv)
    run = results.start("sim_speed", argv)
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
    recorded = run.record({"bare_simpy_timeouts_per_s": bare, **{
        name: {"ops_per_s": m.ops_per_s, "wall_s": m.wall_s, "ops": m.ops}
        for name, m in (("gpus64", small), ("gpus1024", big), ("gpus64_overlapped", compiled),
                        ("gpus64_overlapped_generator", generator),
                        ("gpus1024_overlapped", big_o))}}, args.results_dir)
    print(f"wrote {recorded}")


if __name__ == "__main__":
    main()
