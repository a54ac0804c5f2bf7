"""Llama 3's interruptions as a scenario (scenarios/llama3_interruptions.yaml:
419 in 54 days on 16,384 GPUs, Table 5's mix): goodput against the checkpoint
interval, Young/Daly's optimum beside the best, and the effective training
time beside the paper's (more than 90%) under the costs it does not publish.

    python -m experiments.llama3_goodput [--seeds 5] [--step-s S]

The step is simulated (data-parallel replica 0 of the published layout, its
steady second step; ``--step-s`` gives one instead); the 54 days of steps,
their failures, checkpoints and restarts follow from ``megatronapp.mitigate.
failstop`` (one failure at a time, not every step simulated). Writes
results/llama3_goodput.json and docs/img/failstop-goodput.png.
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from experiments import results
from experiments.render import markdown_table

NAME = "llama3_goodput"
SCENARIO = "scenarios/llama3_interruptions.yaml"
FIGURE = Path("docs/img/failstop-goodput.png")
PUBLISHED_STEP_S = 6 * 405e9 * 16 * 2**20 / (16384 * 400e12)  # 16M tokens at 400 TFLOP/s
RESTARTS_S = (300.0, 600.0, 1200.0)
CHECKPOINTS_S = (3.0, 30.0, 120.0)
GRID_RATIO, GRID_STEPS = 1.25, 10


def simulated_step_s(s: Any) -> float:
    from backends.registry import run_function
    from megatronapp.mitigate.failstop_job import step_s
    from megatronapp.program.backend import RunOptions

    return step_s(s.model_copy(update={"iterations": 2}),
                  run_function("sim", RunOptions(replica=True)))


def goodputs(job: Any, everies: list[int], seeds: int) -> list[list[float]]:
    """Per interval, the goodput on each seed's failure draws."""
    from megatronapp.mitigate.failstop import sweep

    per_seed = [sweep(job, everies, seed) for seed in range(seeds)]
    return [[runs[i].goodput for runs in per_seed] for i in range(len(everies))]


def curve(job: Any, seeds: int) -> dict[str, Any]:
    from megatronapp.mitigate.failstop import geometric_grid, young_daly_s

    optimum = young_daly_s(job.checkpoint_s, job.mtbf_s) / job.iteration_s
    everies = geometric_grid(optimum, GRID_RATIO, GRID_STEPS)
    values = goodputs(job, everies, seeds)
    means = [statistics.fmean(v) for v in values]
    best = everies[max(range(len(means)), key=means.__getitem__)]
    return {"young_daly_steps": optimum, "everies": everies, "goodput": values,
            "best_every": best}


def sensitivity(job: Any, seeds: int) -> list[dict[str, Any]]:
    """Goodput at each checkpoint and restart cost, at its own Young/Daly interval."""
    from megatronapp.mitigate.failstop import young_daly_s

    rows = []
    for checkpoint_s in CHECKPOINTS_S:
        for restart_s in RESTARTS_S:
            j = replace(job, checkpoint_s=checkpoint_s, restart_s=restart_s)
            every = max(1, round(young_daly_s(checkpoint_s, j.mtbf_s) / j.iteration_s))
            values = goodputs(j, [every], seeds)[0]
            rows.append({"checkpoint_s": checkpoint_s, "restart_s": restart_s, "every": every,
                         "goodput_mean": statistics.fmean(values), "goodput_min": min(values),
                         "goodput_max": max(values)})
    return rows


def plot(data: dict[str, Any]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c, step = data["curve"], data["step_s"]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [e * step / 60 for e in c["everies"]]
    for k in range(len(c["goodput"][0])):
        ax.plot(xs, [100 * g[k] for g in c["goodput"]], color="tab:blue", alpha=0.3, lw=0.8,
                label="one seed's failures" if k == 0 else None)
    ax.plot(xs, [100 * statistics.fmean(g) for g in c["goodput"]], "o-", color="tab:blue",
            label=f"mean of {len(c['goodput'][0])} seeds")
    ax.axvline(c["young_daly_steps"] * step / 60, color="tab:red", ls="--",
               label="Young/Daly: sqrt(2 x checkpoint x MTBF)")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (minutes of training)")
    ax.set_ylabel("goodput: training time / wall time (%)")
    ax.set_title(f"Llama 3 405B, 16,384 GPUs, MTBF {data['mtbf_h']:.2f} h, checkpoint "
                 f"{data['checkpoint_s']:g} s, restart {data['restart_s']:g} s", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE, dpi=120)


def main(argv: list[str] | None = None) -> None:
    from megatronapp.mitigate.failstop_job import failstop_job
    from megatronapp.scenario.config import load_scenario

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--step-s", type=float, default=None)
    args = parser.parse_args(argv)
    run = results.start(NAME, argv)
    s = load_scenario(SCENARIO)
    step = args.step_s if args.step_s is not None else simulated_step_s(s)
    job = failstop_job(s, step)
    data = {"step_s": step, "step_source": "given" if args.step_s else "simulated replica",
            "published_step_s": PUBLISHED_STEP_S, "iterations": job.iterations,
            "mtbf_h": job.mtbf_s / 3600, "checkpoint_s": job.checkpoint_s,
            "restart_s": job.restart_s, "failures_in_54_days": 54 * 86400 / job.mtbf_s,
            "curve": curve(job, args.seeds), "sensitivity": sensitivity(job, args.seeds)}
    plot(data)
    print(run.record(data))


def tables(doc: dict[str, Any]) -> dict[str, str]:
    d = doc["data"]
    c = d["curve"]
    means = [statistics.fmean(g) for g in c["goodput"]]
    best = max(range(len(means)), key=means.__getitem__)
    curve_rows = [[e, f"{e * d['step_s'] / 60:.1f}", f"{100 * m:.2f}%",
                   "best" if i == best else ""] for i, (e, m) in enumerate(zip(c["everies"], means))]
    sens = [[f"{r['checkpoint_s']:g}", f"{r['restart_s'] / 60:g}", r["every"],
             f"{100 * r['goodput_mean']:.1f}% ({100 * r['goodput_min']:.1f}-"
             f"{100 * r['goodput_max']:.1f})"] for r in d["sensitivity"]]
    head = [["step (s)", f"{d['step_s']:.3f} ({d['step_source']}; published throughput "
             f"implies {d['published_step_s']:.2f})"],
            ["job MTBF", f"{d['mtbf_h']:.2f} h ({d['failures_in_54_days']:.0f} failures "
             "in 54 days)"],
            ["Young/Daly interval", f"{c['young_daly_steps']:.1f} steps"],
            ["best swept interval", f"{c['best_every']} steps "
             f"({c['best_every'] / c['young_daly_steps']:.2f} x Young/Daly)"]]
    return {"setup": markdown_table(["", "value"], head),
            "curve": markdown_table(["checkpoint every (steps)", "minutes", "goodput (mean)",
                                     ""], curve_rows, "rrrl"),
            "sensitivity": markdown_table(["checkpoint (s)", "restart (min)",
                                           "interval (steps, Young/Daly)",
                                           "effective training time (mean, range over seeds)"],
                                          sens, "rrrl")}


if __name__ == "__main__":
    main()
