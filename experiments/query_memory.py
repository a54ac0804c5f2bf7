"""Memory of ``megatronapp query "SELECT count(*) FROM events"`` beside
``megatronapp detect`` on the same stored run of about 1.17 M events
(``scenarios/scan_1024.yaml``: 1,024 GPUs, one iteration of 32 microbatches).

Each command runs in a child process, ``--repeats`` times; its peak resident
memory and CPU time come from the kernel's accounting of that child
(``os.wait4``), its wall time from the clock. ``--baseline DIR`` also times
the query once with the code in DIR (another checkout, named in the table by
``--baseline-name``) on the same trace.

    python -m experiments.query_memory [--repeats 3] [--baseline DIR --baseline-name NAME]

writes ``results/query_memory.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .render import markdown_table
from .results import ROOT, start

NAME = "query_memory"
SCENARIO = "scenarios/scan_1024.yaml"
COUNT = "SELECT count(*) FROM events"


def measured(argv: list[str], code: Path) -> dict[str, float]:
    """One run of the command line in a child: peak RSS (MB), CPU and wall seconds."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "megatronapp.cli", *argv], cwd=code, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - started
    if status != 0:
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        raise SystemExit(f"{' '.join(argv)} failed: {err[-2000:]}")
    return {"peak_mb": usage.ru_maxrss / 1024, "cpu_s": usage.ru_utime + usage.ru_stime,
            "wall_s": wall}


def median_of(runs: list[dict[str, float]]) -> dict[str, Any]:
    return {**{k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]},
            "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.query_memory")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another checkout: its query timed too")
    parser.add_argument("--baseline-name", default="baseline",
                        help="what the baseline is, as the table shows it (e.g. its commit)")
    args = parser.parse_args(argv)
    run = start(NAME, argv)
    with tempfile.TemporaryDirectory(prefix="query-memory-") as tmp:
        trace = Path(tmp) / "scan_1024"
        subprocess.run([sys.executable, "-m", "megatronapp.cli", "run", SCENARIO, "--out",
                        str(trace), "--quiet"], cwd=ROOT, check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL)
        answer = subprocess.run(
            [sys.executable, "-m", "megatronapp.cli", "query", str(trace),
             "SELECT count(*) AS n FROM events", "--json"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
            text=True, check=True).stdout
        events = int(json.loads(answer)[0]["n"])
        commands = {"query count(*)": ["query", str(trace), COUNT],
                    "detect": ["detect", str(trace)]}
        rows = {name: median_of([measured(a, ROOT) for _ in range(args.repeats)])
                for name, a in commands.items()}
        if args.baseline is not None:
            rows[f"query count(*), {args.baseline_name}"] = median_of(
                [measured(commands["query count(*)"], args.baseline.resolve())])
    data = {"scenario": SCENARIO, "events": events, "repeats": args.repeats,
            "baseline": str(args.baseline) if args.baseline else None, "commands": rows}
    print(markdown_table(*_table(data)))
    run.record(data)
    return 0


def _table(data: dict[str, Any]) -> tuple[list[str], list[list[Any]], str]:
    rows = [[name, f"{r['peak_mb']:,.0f}", f"{r['cpu_s']:.1f}", f"{r['wall_s']:.1f}"]
            for name, r in data["commands"].items()]
    return (["command (1.17 M events)", "peak memory (MB)", "CPU (s)", "wall (s)"], rows, "lrrr")


def tables(doc: dict[str, Any]) -> dict[str, str]:
    return {"table": markdown_table(*_table(doc["data"]))}


if __name__ == "__main__":
    sys.exit(main())
