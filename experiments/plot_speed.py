"""``megatronapp plot`` against ``megatronapp run`` on the quick-start scenario,
in one process: CPU and wall seconds of each (goal: plot CPU <= 3x run CPU).
Matplotlib's import is paid inside ``plot``, as a user pays it.

    .venv/bin/python -m experiments.plot_speed [scenarios/throttle.yaml]
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable

from experiments import results
from megatronapp.cli import main as cli

QUICK_START = Path(__file__).resolve().parents[1] / "scenarios" / "throttle.yaml"


def timed(work: Callable[[], int]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of ``work``, which must succeed."""
    cpu, wall = time.process_time(), time.perf_counter()
    if work() != 0:
        raise SystemExit("the command failed")
    return time.process_time() - cpu, time.perf_counter() - wall


def main(argv: list[str] | None = None) -> None:
    options = results.parser("plot_speed", __doc__)
    options.add_argument("scenario", nargs="?", default=str(QUICK_START))
    results.results_dir_option(options)
    args = options.parse_args(argv)
    scenario, experiment = args.scenario, results.start("plot_speed", argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "run")
        run = timed(lambda: cli(["run", scenario, "--out", out, "--quiet"]))
        plot = timed(lambda: cli(["plot", out]))
    print("| command | CPU (s) | wall (s) |")
    print("|---|---|---|")
    print(f"| run {scenario} | {run[0]:.2f} | {run[1]:.2f} |")
    print(f"| plot | {plot[0]:.2f} | {plot[1]:.2f} |")
    print(f"plot CPU / run CPU = {plot[0] / run[0]:.2f} (goal <= 3)")
    recorded = experiment.record({"scenario": scenario, "run": {"cpu_s": run[0], "wall_s": run[1]},
                                  "plot": {"cpu_s": plot[0], "wall_s": plot[1]}},
                                 args.results_dir)
    print(f"wrote {recorded}")


if __name__ == "__main__":
    main()
