"""MegaFBD on torch: a throttled device slows the decoupled iteration.

    .venv/bin/python -m experiments.fbd_torch_throttle [--scenario FILE] [--device D]
        [--factors 1 2 3] [--repeats 3]

Runs the scenario (default ``scenarios/fbd_torch_small.yaml``: forward and
backward workers of two pipeline stages, one process each, compute-dominated)
on the torch backend with ``{kind: throttle, rank: D, factor: F}`` on one
physical device (default 3: the last stage's backward worker, the busiest
device), repeating every factor, factors interleaved so that a change in the
machine's load hits all of them alike. One row per run: the steady iteration
time (mean period after the first iteration), its ratio to the median
unthrottled one, the throttled device's compute per iteration and the part
of it the throttle injected (``injected_s`` of its compute events: (factor -
1) x the CPU work of each compute), and the run's wall and CPU time (CPU of
the worker processes: a loaded machine shows as CPU well below wall x
processes). Then the medians per factor.
"""
from __future__ import annotations

import argparse
import resource
import time
from statistics import median

from backends.torch import run_scenario
from experiments import results
from megatronapp.scenario.config import load_scenario
from megatronapp.trace.kinds import COMPUTE_NAMES


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(path: str, device: int, factor: float) -> dict[str, float]:
    faults = f"[{{kind: throttle, rank: {device}, factor: {factor}}}]" if factor != 1 else "[]"
    s = load_scenario(path, [f"faults={faults}"])
    wall, cpu = time.perf_counter(), children_cpu_s()
    result = run_scenario(s)
    wall, cpu = time.perf_counter() - wall, children_cpu_s() - cpu
    fbd = result.fbd
    assert fbd is not None, "an FBD run's result has its fbd section"
    workers = [int(w) for w, d in fbd.device_of_worker.items() if d == device]
    computes = [e for w in workers for e in result.events[w] if e.name in COMPUTE_NAMES]
    return {"iteration_s": fbd.steady_iteration_s,
            "compute_s": sum(e.dur_s for e in computes) / s.iterations,
            "injected_s": sum(e.args.get("injected_s", 0.0) for e in computes) / s.iterations,
            "wall_s": wall, "cpu_s": cpu}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="scenarios/fbd_torch_small.yaml")
    parser.add_argument("--device", type=int, default=3, help="physical device to throttle")
    parser.add_argument("--factors", type=float, nargs="+", default=[1.0, 2.0, 3.0])
    parser.add_argument("--repeats", type=int, default=3)
    results.results_dir_option(parser)
    args = parser.parse_args(argv)
    experiment = results.start("fbd_torch_throttle", argv)
    factors = sorted(set(args.factors) | {1.0})
    print(f"{len(factors) * args.repeats} torch runs of {args.scenario}, throttling device "
          f"{args.device}", flush=True)
    header = (f"{'factor':>6} {'rep':>3} {'iteration ms':>12} {'ratio':>6} "
              f"{'device compute ms/it':>20} {'injected ms/it':>14} {'wall s':>7} {'CPU s':>7}")
    print(header + "\n" + "-" * len(header), flush=True)
    runs: dict[float, list[dict[str, float]]] = {f: [] for f in factors}
    for rep in range(args.repeats):
        for factor in factors:
            row = one_run(args.scenario, args.device, factor)
            runs[factor].append(row)
            base = median(r["iteration_s"] for r in runs[1.0]) if runs[1.0] else float("nan")
            print(f"{factor:6g} {rep:3d} {row['iteration_s'] * 1e3:12.1f} "
                  f"{row['iteration_s'] / base:6.2f} {row['compute_s'] * 1e3:20.1f} "
                  f"{row['injected_s'] * 1e3:14.1f} {row['wall_s']:7.1f} {row['cpu_s']:7.1f}",
                  flush=True)
    base = median(r["iteration_s"] for r in runs[1.0])
    print(f"\nmedians over {args.repeats} runs")
    print(f"{'factor':>6} {'iteration ms':>12} {'ratio':>6} {'device compute ms/it':>20} "
          f"{'injected ms/it':>14} {'wall s':>7} {'CPU s':>7}")
    for factor, rows in runs.items():
        it = median(r["iteration_s"] for r in rows)
        print(f"{factor:6g} {it * 1e3:12.1f} {it / base:6.2f} "
              f"{median(r['compute_s'] for r in rows) * 1e3:20.1f} "
              f"{median(r['injected_s'] for r in rows) * 1e3:14.1f} "
              f"{median(r['wall_s'] for r in rows):7.1f} {median(r['cpu_s'] for r in rows):7.1f}")
    recorded = experiment.record(
        {"scenario": args.scenario, "device": args.device, "repeats": args.repeats,
         "runs": [{"factor": f, "repeat": rep, **row} for f, rows in runs.items()
                  for rep, row in enumerate(rows)]}, args.results_dir)
    print(f"wrote {recorded}")


if __name__ == "__main__":
    main()
