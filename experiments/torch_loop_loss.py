"""The closed loop on real ranks, as a loss curve: a 4-rank gloo job (dp 4)
whose rank 1 runs 4x slower from the start is stopped by on-line MegaScan's
verdict, restarts from its last checkpoint without that rank (dp 2, twice the
microbatches, the same global batch) and trains to the end; beside it the same
job without the fault, never stopped.

    .venv/bin/python -m experiments.torch_loop_loss [--iterations 30] [--every 4]
        [--runs runs/torch-loop] [--out docs/img/torch-loop-loss.png]

Writes both run directories under ``--runs`` (``faulty/`` with its
``segment1/``, ``healthy/``) and the figure.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from experiments import results
from megatronapp.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios/throttle.yaml"
FAULT = "[{kind: throttle, rank: 1, factor: 4}]"


def job_args(iterations: int, every: int, action: str) -> list[str]:
    sets = ["parallel={tp: 1, pp: 1, dp: 4, microbatches: 2}",
            "model={layers: 2, hidden: 32, heads: 4, seq_len: 8, vocab: 64, micro_batch_size: 2}",
            f"iterations={iterations}", "cluster.jitter={}", "cluster.gpus_per_node=1",
            "training={optimizer: adam, lr: 0.01}",
            # verdicts a loaded machine's descheduling draws stay below 0.7 or pass
            f"mitigation={{action: {action}, restart_s: 1, checkpoint_every: {every}, "
            "min_confidence: 0.7, hold_iterations: 2}"]
    return [arg for kv in sets for arg in ("--set", kv)]


def run(out: Path, iterations: int, every: int, action: str, faults: str) -> dict[str, Any]:
    code = cli(["run", str(SCENARIO), "--backend", "torch", "--quiet", "--force",
                *job_args(iterations, every, action), "--set", f"faults={faults}",
                "--out", str(out)])
    if code:
        raise SystemExit(code)
    return json.loads((out / "summary.json").read_text())


def plot(faulty: dict[str, Any], again: dict[str, Any], healthy: dict[str, Any],
         out: Path) -> None:
    first, second = faulty["mitigation"]["segments"]
    resumed, stopped = second["first_iteration"], first["iterations"] - 1
    fig = Figure(figsize=(7, 4))  # no pyplot: no display backend to choose
    ax = fig.subplots()
    ax.plot(range(len(healthy["loss_per_iteration"])), healthy["loss_per_iteration"],
            color="0.6", lw=3, label="healthy job, never stopped (dp 4)")
    ax.plot(range(first["iterations"]), faulty["loss_per_iteration"], "o-", ms=3,
            label=f"segment 1: rank 1 throttled 4x (dp {first['dp']})")
    ax.plot(range(resumed, resumed + len(again["loss_per_iteration"])),
            again["loss_per_iteration"], "s-", ms=3,
            label=f"segment 2: without rank 1 (dp {second['dp']}, "
                  f"{second['microbatches']} microbatches)")
    ax.axvline(resumed, color="tab:green", ls="--", label=f"checkpoint restarted from ({resumed})")
    ax.axvline(stopped + 0.5, color="tab:red", ls=":",
               label=f"stopped after iteration {stopped} (verdict at "
                     f"{first['stopped_by']['iteration']})")
    ax.set_xlabel("iteration of the job")
    ax.set_ylabel("training loss (mean over the global batch)")
    ax.set_title("Closed loop on torch: stop, restart without the slow rank, loss continues")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--every", type=int, default=4, help="iterations between checkpoints")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs/torch-loop")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/img/torch-loop-loss.png")
    results.results_dir_option(parser)
    args = parser.parse_args(argv)
    experiment = results.start("torch_loop_loss", argv)
    faulty = run(args.runs / "faulty", args.iterations, args.every, "exclude", FAULT)
    healthy = run(args.runs / "healthy", args.iterations, args.every, "none", "[]")
    if faulty["mitigation"]["restarts"] != 1:
        raise SystemExit(f"the loop restarted the job {faulty['mitigation']['restarts']} times, "
                         "not once")
    again = json.loads((args.runs / "faulty/segment1/summary.json").read_text())
    plot(faulty, again, healthy, args.out)
    print(f"wrote {args.out}")
    recorded = experiment.record(
        {"iterations": args.iterations, "checkpoint_every": args.every, "fault": FAULT,
         "figure": results.shown(args.out), "mitigation": faulty["mitigation"],
         "loss": {"faulty": faulty["loss_per_iteration"],
                  "faulty_segment1": again["loss_per_iteration"],
                  "healthy": healthy["loss_per_iteration"]}}, args.results_dir)
    print(f"wrote {recorded}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
