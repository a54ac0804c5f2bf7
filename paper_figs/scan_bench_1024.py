"""Time `megatronapp detect` on the 1024-rank trace, pinned to one core.

    .venv/bin/python paper_figs/scan_bench_1024.py [RUN_DIR]

Generates RUN_DIR (default runs/scan_1024) from scenarios/scan_1024.yaml if it
is missing, then times what ``megatronapp detect`` runs (the stored table read
as columns, linked, aligned and judged), each stage of the per-event path the
other commands use (load every rank's events on its own clock, link sync ops,
align clocks, detect), and the critical path that ``megatronapp analyze``
adds, and prints a table.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    run_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "runs" / "scan_1024"
    if not (run_dir / "trace.parquet").is_file():
        subprocess.run([sys.executable, "-m", "megatronapp.cli", "run",
                        str(ROOT / "scenarios" / "scan_1024.yaml"), "--out", str(run_dir),
                        "--quiet"], check=True)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    from megatronapp.scan.critical import critical_path
    from megatronapp.scan.deps import reconstruct
    from megatronapp.scan.detect import megascan
    from megatronapp.scan.inputs import ScanInput, gpus_per_node_of
    from megatronapp.scan.align import apply_clocks, fit_clocks
    from megatronapp.scan.load import load_trace
    from megatronapp.scan.table import load_table_scan
    from megatronapp.scan.table_detect import megascan_table

    stages: list[tuple[str, float, float]] = []

    def timed(name, fn, *args):
        w, c = time.perf_counter(), time.process_time()
        out = fn(*args)
        stages.append((name, time.perf_counter() - w, time.process_time() - c))
        return out

    table = timed("detect: read the table as columns, link, align", load_table_scan,
                  run_dir / "trace.parquet")
    timed("detect: judge (megascan on columns)", megascan_table, table)
    trace = timed("per-event path: load every rank's events", load_trace, run_dir)
    ops = timed("link sync ops", reconstruct, trace.events)
    fits = timed("fit clocks", fit_clocks, trace.events, ops, 0)
    aligned = timed("apply clocks", apply_clocks, trace.events, fits)
    scan = ScanInput(aligned, tuple(ops), gpus_per_node_of(run_dir), fits)
    diagnosis = timed("detect (per-event)", megascan, scan)
    path = timed("critical path (analyze)", critical_path, aligned, ops)
    events = sum(len(v) for v in trace.events.values())
    print(f"{len(trace.events)} ranks, {events} events, {len(ops)} sync ops; "
          f"root causes {[c.rank for c in diagnosis.root_causes]}; critical path "
          f"{100 * path.length_s / path.window_s:.1f}% of the window, "
          f"top rank {next(iter(path.by_rank()))}")
    print("| stage | wall s | cpu s |\n|---|---:|---:|")
    for name, wall, cpu in stages:
        print(f"| {name} | {wall:.2f} | {cpu:.2f} |")
    print(f"| total | {sum(s[1] for s in stages):.2f} | {sum(s[2] for s in stages):.2f} |")


if __name__ == "__main__":
    main()
