"""Time `megatronapp detect` on the 1024-rank trace, pinned to one core.

    .venv/bin/python -m experiments.scan_bench_1024 [RUN_DIR]

Generates RUN_DIR (default runs/scan_1024) from scenarios/scan_1024.yaml if it
is missing, then times what ``megatronapp detect`` runs (the stored table read
as columns, linked, aligned and judged), the loader the other commands use
(every rank's events on its own clock, then the same columns, linking and
alignment), and the critical path that ``megatronapp analyze`` adds, and
prints a table.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from experiments import results

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    options = results.parser("scan_bench_1024", __doc__)
    options.add_argument("run_dir", nargs="?", type=Path, default=ROOT / "runs" / "scan_1024")
    results.results_dir_option(options)
    args = options.parse_args(argv)
    run_dir, experiment = args.run_dir, results.start("scan_bench_1024", argv)
    if not (run_dir / "trace.parquet").is_file():
        subprocess.run([sys.executable, "-m", "megatronapp.cli", "run",
                        str(ROOT / "scenarios" / "scan_1024.yaml"), "--out", str(run_dir),
                        "--quiet"], check=True)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    from megatronapp.scan.evidence.critical import critical_path
    from megatronapp.scan.evidence.detect import megascan
    from megatronapp.scan.align.inputs import load_table_scan, prepare_loaded
    from megatronapp.scan.ingest.load import load_trace

    stages: list[tuple[str, float, float]] = []

    def timed(name, fn, *args):
        w, c = time.perf_counter(), time.process_time()
        out = fn(*args)
        stages.append((name, time.perf_counter() - w, time.process_time() - c))
        return out

    table = timed("detect: read the table as columns, link, align", load_table_scan,
                  run_dir / "trace.parquet")
    diagnosis = timed("detect: judge (megascan)", megascan, table)
    trace = timed("other commands: load every rank's events", load_trace, run_dir)
    scan = timed("link sync ops, align clocks", prepare_loaded, trace)
    ops = timed("per-event sync ops", lambda: scan.ops)
    path = timed("critical path (analyze)", critical_path, scan.events, list(ops))
    events = sum(len(v) for v in scan.events.values())
    print(f"{len(scan.events)} ranks, {events} events, {len(ops)} sync ops; "
          f"root causes {[c.rank for c in diagnosis.root_causes]}; critical path "
          f"{100 * path.length_s / path.window_s:.1f}% of the window, "
          f"top rank {next(iter(path.by_rank()))}")
    print("| stage | wall s | cpu s |\n|---|---:|---:|")
    for name, wall, cpu in stages:
        print(f"| {name} | {wall:.2f} | {cpu:.2f} |")
    print(f"| total | {sum(s[1] for s in stages):.2f} | {sum(s[2] for s in stages):.2f} |")
    recorded = experiment.record(
        {"run_dir": str(run_dir), "ranks": len(scan.events), "events": events,
         "sync_ops": len(ops), "root_causes": [c.rank for c in diagnosis.root_causes],
         "critical_path_share": path.length_s / path.window_s,
         "stages": [{"stage": name, "wall_s": wall, "cpu_s": cpu}
                    for name, wall, cpu in stages]}, args.results_dir)
    print(f"wrote {recorded}")


if __name__ == "__main__":
    main()
