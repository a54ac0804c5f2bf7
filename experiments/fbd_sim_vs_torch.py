"""MegaFBD: the simulator's iteration time against a torch run of the same scenario.

    .venv/bin/python -m experiments.fbd_sim_vs_torch [--scenario FILE] [--repeats N]

Each repetition runs the scenario (default ``scenarios/fbd_torch_small.yaml``)
on the torch backend, takes the costs the simulator cannot know from that
run's trace and control threads, and simulates the same scenario with them
as fixed ``costs:``:

- ``forward_s``: mean duration of the forward workers' ``forward`` and the
  backward workers' ``recompute_forward`` (the simulator prices both alike);
- ``backward_s``, ``optimizer_s``: means of ``backward`` and ``optimizer``
  (means, not medians: on a shared CPU the slow tail is part of the work);
- ``p2p_s``: mean time a control thread spent running a launched transfer;
- ``allreduce_s`` (prices the coordinator's alignment all-reduce, the only
  all-reduce of a dp = 1 job): the least mean alignment time of any worker
  process (the last one to enter a round waits least: that is the
  all-reduce's own cost, not the wait for others).

Both backends run the same round loop with the same ``fbd.round_nap_s``.
Printed: the measured costs, both steady iteration times (mean period after
the first iteration) and the simulator's error.
"""
from __future__ import annotations

import argparse
from statistics import fmean
from typing import Any

from backends.torch.fbd_worker import FBD
from experiments import results
from backends.torch.launch import spawn_run
from megatronapp.scenario.config import Scenario, load_scenario
from sim import simulate as run_sim_scenario


def durations(events: dict[int, list[Any]], *names: str) -> list[float]:
    return [e.dur_s for evs in events.values() for e in evs if e.name in names]


def measured_costs(run: Any, workers: list[Any]) -> dict[str, float]:
    ev = run.events
    return {
        "forward_s": fmean(durations(ev, "forward", "recompute_forward")),
        "backward_s": fmean(durations(ev, "backward")),
        "optimizer_s": fmean(durations(ev, "optimizer")),
        "p2p_s": sum(r.execute_s for r in workers) / sum(r.executions for r in workers),
        "allreduce_s": min(r.align_s / r.rounds for r in workers),
    }


def simulated(s: Scenario, costs: dict[str, float]) -> float:
    """The simulator's steady iteration time of ``s`` with fixed ``costs``."""
    timed = s.model_copy(update={"costs": s.costs.model_copy(update=costs)})
    fbd = run_sim_scenario(timed).fbd
    assert fbd is not None, "an FBD scenario's result has its fbd section"
    return fbd.steady_iteration_s


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="scenarios/fbd_torch_small.yaml")
    parser.add_argument("--repeats", type=int, default=1)
    results.results_dir_option(parser)
    args = parser.parse_args(argv)
    experiment, rows = results.start("fbd_sim_vs_torch", argv), []
    s = load_scenario(args.scenario)
    print(f"{args.repeats} torch run(s) of {args.scenario}, each simulated with its "
          "measured costs", flush=True)
    header = (f"{'rep':>3} {'fwd ms':>7} {'bwd ms':>7} {'opt ms':>7} {'p2p ms':>7} "
              f"{'round ms':>8} {'torch it ms':>11} {'sim it ms':>9} {'error':>7}")
    print(header + "\n" + "-" * len(header), flush=True)
    errors = []
    for rep in range(args.repeats):
        run, workers = spawn_run(s, job=FBD)
        costs = measured_costs(run, workers)
        assert run.fbd is not None, "an FBD run's result has its fbd section"
        torch_s = run.fbd.steady_iteration_s
        sim_s = simulated(s, costs)
        errors.append(sim_s / torch_s - 1)
        rows.append({"repeat": rep, "costs": costs, "torch_iteration_s": torch_s,
                     "sim_iteration_s": sim_s, "error": errors[-1]})
        print(f"{rep:3d} {costs['forward_s'] * 1e3:7.1f} {costs['backward_s'] * 1e3:7.1f} "
              f"{costs['optimizer_s'] * 1e3:7.1f} {costs['p2p_s'] * 1e3:7.2f} "
              f"{costs['allreduce_s'] * 1e3:8.2f} {torch_s * 1e3:11.1f} {sim_s * 1e3:9.1f} "
              f"{errors[-1]:+7.1%}", flush=True)
    print(f"\nmean error of the simulator over {len(errors)} run(s): {fmean(errors):+.1%}")
    recorded = experiment.record({"scenario": args.scenario, "rows": rows,
                                  "mean_error": fmean(errors)}, args.results_dir)
    print(f"wrote {recorded}")


if __name__ == "__main__":
    main()
