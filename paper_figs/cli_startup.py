"""Start-up time of the command line: ``megatronapp --help`` and friends, run
as fresh processes; median wall time beside median CPU time (user + system of
the child), so load on a shared machine shows as the gap between the two.

    .venv/bin/python paper_figs/cli_startup.py [--runs 11]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=11, help="runs per command (median)")
    runs = parser.parse_args().runs
    print(f"load average {os.getloadavg()[0]:.1f}, {runs} runs each")
    print("| command | median wall s | median CPU s |")
    print("|---|---|---|")
    for args in COMMANDS:
        samples = [once(args) for _ in range(runs)]
        wall = statistics.median(s[0] for s in samples)
        cpu = statistics.median(s[1] for s in samples)
        print(f"| megatronapp {' '.join(args)} | {wall:.3f} | {cpu:.3f} |")


if __name__ == "__main__":
    main()
