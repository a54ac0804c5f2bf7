"""Start-up time of the command line: ``megatronapp --help`` and friends, run
as fresh processes; median wall time beside median CPU time (user + system of
the child), so load on a shared machine shows as the gap between the two.

    .venv/bin/python -m experiments.cli_startup [--runs 11]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from experiments import results

COMMANDS = (["--help"], ["--version"], ["run", "--help"], ["detect", "--help"],
            ["topology", "--tp", "x"])


def once(args: list[str]) -> tuple[float, float]:
    """(wall s, CPU s) of one ``python -m megatronapp.cli ARGS``."""
    before = os.times()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "megatronapp.cli", *args], capture_output=True,
                   check=False)
    wall = time.perf_counter() - start
    after = os.times()
    return wall, (after.children_user - before.children_user
                   + after.children_system - before.children_system)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=11, help="runs per command (median)")
    results.results_dir_option(parser)
    args = parser.parse_args(argv)
    runs, run = args.runs, results.start("cli_startup", argv)
    print(f"load average {os.getloadavg()[0]:.1f}, {runs} runs each")
    print("| command | median wall s | median CPU s |")
    print("|---|---|---|")
    rows = []
    for command in COMMANDS:
        samples = [once(command) for _ in range(runs)]
        wall = statistics.median(s[0] for s in samples)
        cpu = statistics.median(s[1] for s in samples)
        rows.append({"command": command, "wall_s": wall, "cpu_s": cpu})
        print(f"| megatronapp {' '.join(command)} | {wall:.3f} | {cpu:.3f} |")
    print(f"wrote {run.record({'runs': runs, 'rows': rows}, args.results_dir)}")


if __name__ == "__main__":
    main()
