"""The closed loop's command: ``megatronapp failstop`` prices a long job's
crashes, checkpoints and restarts, and sweeps the checkpoint interval."""
from __future__ import annotations

import argparse
import json
import math
from typing import Any

from megatronapp.errors import UserError
from megatronapp.host import limits


def cmd_failstop(args: argparse.Namespace) -> int:
    from backends.registry import run_function
    from megatronapp.program.backend import RunOptions
    from megatronapp.scenario.config import Mitigation, load_scenario

    from .failstop import geometric_grid, sweep, young_daly_s
    from .failstop_job import STEPS_SIMULATED, failstop_job, step_s, without_stops

    if not args.ratio > 1 or args.steps < 1:
        raise UserError("--ratio: must be > 1 (and --steps >= 1)")
    s = load_scenario(args.scenario, args.set)
    first = without_stops(s, min(STEPS_SIMULATED, s.iterations))
    if args.replica and first.faults:
        raise UserError("--replica: one replica stands for all only without faults other "
                        "than fail-stop ones")
    if not args.replica:  # one replica is a small fraction of the job: not estimated whole
        limits.enforce(args, limits.estimate_run(first), what="simulating the first steps")
    job = failstop_job(s, step_s(s, run_function("sim", RunOptions(replica=args.replica))))
    every = (s.mitigation or Mitigation()).checkpoint_every
    optimum = young_daly_s(job.checkpoint_s, job.mtbf_s) / job.iteration_s
    everies = sorted({every, *geometric_grid(optimum, args.ratio, args.steps)}) \
        if args.sweep else [every]
    runs = sweep(job, everies, args.seed)
    if args.json:
        print(json.dumps({"step_s": job.iteration_s, "mtbf_s": job.mtbf_s,
                          "young_daly_iterations": optimum,
                          "runs": [r.to_json() for r in runs]}, indent=2))
        return 0
    for line in report_lines(job, optimum, runs, every):
        print(line)
    return 0


def report_lines(job: Any, optimum: float, runs: list[Any], every: int) -> list[str]:
    best = max(runs, key=lambda r: r.goodput)
    lines = [f"step {job.iteration_s:.4g} s (simulated), {job.iterations} steps, job MTBF "
             f"{job.mtbf_s / 3600:.4g} h, checkpoint {job.checkpoint_s:g} s, restart "
             f"{job.restart_s:g} s",
             f"Young/Daly: a checkpoint every {optimum:.1f} steps "
             f"({optimum * job.iteration_s:.4g} s)",
             "| checkpoint every | failures | lost (h) | restarts (h) | checkpoints (h) | "
             "wall (h) | goodput |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        mark = " (scenario)" if r.checkpoint_every == every else ""
        mark += " (best)" if r is best else ""
        lines.append(f"| {r.checkpoint_every}{mark} | {r.failures} | {r.lost_s / 3600:.2f} | "
                     f"{r.restarts_s / 3600:.2f} | {r.checkpoints_s / 3600:.2f} | "
                     f"{r.wall_s / 3600:.2f} | {100 * r.goodput:.2f}% |")
    if math.isfinite(optimum) and len(runs) > 1:
        lines.append(f"best swept interval / Young-Daly: {best.checkpoint_every / optimum:.3f}")
    return lines


def register(subparsers: Any, plot_hooks: list) -> None:
    """Add this module's subcommands; ``plot_hooks`` gets extra plotters."""
    fs = subparsers.add_parser(
        "failstop", help="a long job's crashes, checkpoints and restarts: its goodput, and "
                         "the checkpoint interval swept")
    fs.add_argument("scenario", help="scenario YAML with crash faults (mtbf_hours) and a "
                                     "mitigation section (checkpoint_every, checkpoint_s, "
                                     "restart_s)")
    fs.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a scenario key (repeatable)")
    fs.add_argument("--sweep", action="store_true",
                    help="also every interval of a geometric grid around Young/Daly's")
    fs.add_argument("--ratio", type=float, default=1.25, help="the grid's step ratio")
    fs.add_argument("--steps", type=int, default=8, help="grid points each way")
    fs.add_argument("--seed", type=int, default=0, help="seed of the failure draws")
    fs.add_argument("--replica", action="store_true",
                    help="the step from data-parallel replica 0 alone (exact without other "
                         "faults or jitter; for jobs too large to simulate whole)")
    fs.add_argument("--json", action="store_true", help="print JSON instead of a table")
    limits.add_options(fs)
    fs.set_defaults(func=cmd_failstop)
