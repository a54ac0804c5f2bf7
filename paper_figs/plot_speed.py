"""``megatronapp plot`` against ``megatronapp run`` on the quick-start scenario,
in one process: CPU and wall seconds of each (goal: plot CPU <= 3x run CPU).
Matplotlib's import is paid inside ``plot``, as a user pays it.

    PYTHONPATH=$PWD .venv/bin/python paper_figs/plot_speed.py [scenarios/throttle.yaml]
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from megatronapp.cli import main as cli

QUICK_START = Path(__file__).resolve().parents[1] / "scenarios" / "throttle.yaml"


def timed(work: Callable[[], int]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of ``work``, which must succeed."""
    cpu, wall = time.process_time(), time.perf_counter()
    if work() != 0:
        raise SystemExit("the command failed")
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    scenario = sys.argv[1] if len(sys.argv) > 1 else str(QUICK_START)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "run")
        run = timed(lambda: cli(["run", scenario, "--out", out, "--quiet"]))
        plot = timed(lambda: cli(["plot", out]))
    print("| command | CPU (s) | wall (s) |")
    print("|---|---|---|")
    print(f"| run {scenario} | {run[0]:.2f} | {run[1]:.2f} |")
    print(f"| plot | {plot[0]:.2f} | {plot[1]:.2f} |")
    print(f"plot CPU / run CPU = {plot[0] / run[0]:.2f} (goal <= 3)")


if __name__ == "__main__":
    main()
