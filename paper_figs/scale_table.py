"""MegaScale-size jobs on one core: `megatronapp run` and `detect` at 1k-98k GPUs,
estimated against measured, and the simulation core with jitter on every link
against a bare SimPy loop.

    .venv/bin/python paper_figs/scale_table.py [--gpus 1024,12288,49152,98304]
        [--jitter-gpus 12288] [--skip-jitter] [--skip-core-ratio]

Every job is scenarios/megascale_12288.yaml (175B, tp 8, pp 8, interleaved with
6 chunks, 32 microbatches, one iteration) with dp = GPUs / 64, one GPU
throttled to 1.3x and one pipeline link 3x slow at the same coordinates. The
jitter row is the same job at ``--jitter-gpus`` with background jitter on every
link (lognormal sigma 0.05): no two pipelines alike, nothing reduced, every
event simulated and stored, as a real trace would be.
Each command runs as a child pinned to one core (the first CPU of this
process's affinity); wall time, CPU time (user + system) and peak resident
memory come from the child's own rusage. The jitter part simulates the job
with background jitter on every link (lognormal sigma 0.05), where no two
pipelines are alike and nothing can be reduced, and times the simulation core
(CPU seconds per operation) against a bare SimPy timeout loop in the same
process, alternating the two three times and keeping each one's best.

Beside each measurement stands what the limits check estimated before the
work (``megatronapp.host.limits``: the run from the simulator's count of what
it will do, detect from the trace's size), computed in a child of its own, and
the bare SimPy rate measured by a child on the same core just before the run.
A command refused by its limits check is reported with its one line.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's packages, not an installed copy
SCENARIO = ROOT / "scenarios" / "megascale_12288.yaml"
OUT = ROOT / "paper_figs" / "out"
TP, PP = 8, 8


def faults_for(dp: int) -> str:
    """The 12,288-GPU scenario's faults moved to the same places of a smaller job."""
    def rank(d: int, p: int, t: int) -> int:
        return t + TP * (d + dp * p)

    throttled = rank(dp * 49 // 192, 3, 0)
    a, b = rank(dp * 90 // 192, 5, 3), rank(dp * 90 // 192, 6, 3)
    return (f"[{{kind: throttle, rank: {throttled}, factor: 1.3}}, "
            f"{{kind: slow_link, ranks: [{a}, {b}], factor: 3.0}}]")


def measured(cmd: list[str], refusable: bool = False) -> dict[str, object]:
    """Wall, CPU (user + system) and peak RSS of one child process; a refusal by
    the limits check (exit 2, ``limits:``) is kept as ``refused`` when allowed."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _pid, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    out = proc.stdout.read() if proc.stdout else ""
    err = proc.stderr.read() if proc.stderr else ""
    code = os.waitstatus_to_exitcode(status)
    refused = refusable and code == 2 and "limits:" in err
    if code != 0 and not refused:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_gb": usage.ru_maxrss / 1e6, "stdout": out,
            "refused": err.strip().removeprefix("megatronapp: ") if refused else ""}


ESTIMATES = """
import json, sys
from pathlib import Path
from megatronapp.host import limits
from megatronapp.scenario.config import load_scenario
from megatronapp.scan.ingest.load import locate_trace, trace_size
from sim import run_size
if sys.argv[1] == "run":
    e = limits.estimate_run(load_scenario(sys.argv[2], sys.argv[3:]), run_size)
else:
    from megatronapp.scan.align.inputs import batching
    store = locate_trace(Path(sys.argv[2]))
    events = trace_size(store).stored_events
    e = limits.estimate_trace(events, 0, limits.COSTS.detect_columns, batching(store.paths[0]))
print(json.dumps({"events": e.events, "simulated": e.simulated_events, "seconds": e.seconds,
                  "memory_gb": e.memory_bytes / 1e9}))
"""


def estimated(*args: str) -> dict[str, float]:
    """The limits check's estimate (``run SCENARIO SETS...`` or ``detect RUN_DIR``)."""
    done = subprocess.run([sys.executable, "-c", ESTIMATES, *args], cwd=ROOT, text=True,
                          capture_output=True, check=True)
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def bare_rate() -> float:
    """A bare SimPy loop's timeouts per second, in a child on this core."""
    done = subprocess.run([sys.executable, "-c", "from sim import bare_simpy_events_per_s; "
                           "print(bare_simpy_events_per_s())"], cwd=ROOT, text=True,
                          capture_output=True, check=True)
    return float(done.stdout)


JITTER = "cluster.jitter.link_sigma=0.05"  # every link its own: nothing to reduce


def one_size(gpus: int, workdir: Path, jitter: bool = False) -> dict[str, object]:
    dp = gpus // (TP * PP)
    run_dir = workdir / f"megascale_{gpus}{'_jitter' if jitter else ''}"
    cli = [sys.executable, "-m", "megatronapp.cli"]
    sets = [f"parallel.dp={dp}", f"faults={faults_for(dp)}"] + ([JITTER] if jitter else [])
    run_estimate = estimated("run", str(SCENARIO), *sets)
    bare = bare_rate()
    run = measured(cli + ["run", str(SCENARIO), "--out", str(run_dir), "--quiet",
                          *[a for x in sets for a in ("--set", x)]])
    detect_estimate = estimated("detect", str(run_dir))
    detect = measured(cli + ["detect", str(run_dir), "--json"], refusable=True)
    named = "refused" if detect["refused"] else " ".join(sorted(
        f"{c['kind']}:{c['rank']}" + (f"-{c['peer']}" if c["peer"] is not None else "")
        for c in json.loads(str(detect["stdout"]))["root_causes"]))
    trace = json.loads((run_dir / "summary.json").read_text())["trace"]
    trace_mb = (run_dir / "trace.parquet").stat().st_size / 1e6
    shutil.rmtree(run_dir)  # the next size needs the disk
    return {"gpus": gpus, "jitter": jitter, "events": trace["events"],
            "stored_events": trace.get("stored_events", trace["events"]),
            "est_events": run_estimate["events"], "est_simulated": run_estimate["simulated"],
            "run_wall_s": run["wall_s"], "run_cpu_s": run["cpu_s"], "est_run_s":
            run_estimate["seconds"], "run_peak_gb": run["peak_gb"],
            "est_run_gb": run_estimate["memory_gb"],
            "trace_mb": trace_mb, "bare_timeouts_per_s": bare,
            "detect_wall_s": detect["wall_s"], "detect_cpu_s": detect["cpu_s"],
            "est_detect_s": detect_estimate["seconds"], "est_detect_events":
            detect_estimate["events"], "detect_peak_gb": detect["peak_gb"],
            "est_detect_gb": detect_estimate["memory_gb"], "named": named,
            "detect_refused": detect["refused"]}


def jitter_ratio(gpus: int) -> dict[str, float]:
    """Simulation core with jitter everywhere vs a bare SimPy timeout, CPU time per op."""
    from sim.engine import Engine
    from megatronapp.scenario.config import load_scenario
    from megatronapp.run.jobs import compile_static
    from sim import bare_simpy_cpu_s_per_event
    from sim.cluster import build_cluster
    from sim.symmetry import pipe_classes

    s = load_scenario(SCENARIO, [f"parallel.dp={gpus // (TP * PP)}",
                                 f"faults={faults_for(gpus // (TP * PP))}",
                                 "cluster.jitter.link_sigma=0.05"])
    program = compile_static(s)
    assert program is not None
    cores, bares = [], []
    for _ in range(3):
        bares.append(bare_simpy_cpu_s_per_event())
        cluster = build_cluster(s)
        classes = pipe_classes(cluster)
        assert not classes.reduced, "jitter on every link leaves nothing to reduce"
        engine = Engine(cluster, program, classes)
        start = time.process_time()
        engine.run()
        cores.append((time.process_time() - start) / (program.events_per_pipe * len(classes.classes)))
        del engine, cluster
    return {"gpus": gpus, "ops": program.events_per_pipe * s.parallel.dp * TP,
            "core_us_per_op": min(cores) * 1e6, "bare_us_per_timeout": min(bares) * 1e6,
            "ratio": min(cores) / min(bares)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="1024,12288,49152,98304")
    parser.add_argument("--jitter-gpus", type=int, default=12288)
    parser.add_argument("--skip-jitter", action="store_true", help="no jitter row")
    parser.add_argument("--skip-core-ratio", action="store_true",
                        help="no simulation-core vs bare SimPy comparison")
    args = parser.parse_args()
    print(f"load average at the start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
          file=sys.stderr, flush=True)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # children inherit one core
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
        for gpus in (int(g) for g in args.gpus.split(",")):
            rows.append(one_size(gpus, Path(tmp)))
            print(f"done {gpus} GPUs", file=sys.stderr, flush=True)
        if not args.skip_jitter:
            rows.append(one_size(args.jitter_gpus, Path(tmp), jitter=True))
            print(f"done {args.jitter_gpus} GPUs with jitter", file=sys.stderr, flush=True)
    with open(OUT / "scale_table.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print("| GPUs | events (stored; est.) | run wall s | run CPU s (est.) | run peak GB (est.) | "
          "trace.parquet MB | detect wall s | detect CPU s (est.) | detect peak GB (est.) | "
          "detect names | bare SimPy timeouts/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        label = f"{r['gpus']:,}" + (", jitter on every link" if r["jitter"] else "")
        detect = (f"{r['detect_wall_s']:.1f} | {r['detect_cpu_s']:.1f} ({r['est_detect_s']:.0f}) | "
                  f"{r['detect_peak_gb']:.2f} ({r['est_detect_gb']:.1f})"
                  if not r["detect_refused"] else f"refused | ({r['est_detect_s']:.0f}) | "
                  f"({r['est_detect_gb']:.1f})")
        print(f"| {label} | {r['events']:,} ({r['stored_events']:,}; {r['est_events']:,}) | "
              f"{r['run_wall_s']:.1f} | {r['run_cpu_s']:.1f} ({r['est_run_s']:.1f}) | "
              f"{r['run_peak_gb']:.2f} ({r['est_run_gb']:.2f}) | {r['trace_mb']:.1f} | "
              f"{detect} | {r['named']} | {r['bare_timeouts_per_s'] / 1e3:,.0f} k |")
    for r in rows:
        if r["est_events"] != r["events"] or r["est_detect_events"] != r["events"]:
            print(f"{r['gpus']:,} GPUs: estimated {r['est_events']:,} events (detect "
                  f"{r['est_detect_events']:,}), ran {r['events']:,}")
        if r["detect_refused"]:
            print(f"{r['gpus']:,} GPUs: detect {r['detect_refused']}")
    if not args.skip_core_ratio:
        j = jitter_ratio(args.jitter_gpus)
        print(f"\njitter on every link, {j['gpus']:,} GPUs ({j['ops']:,} operations, no "
              f"reduction): simulation core {j['core_us_per_op']:.2f} CPU-us/op, bare SimPy "
              f"{j['bare_us_per_timeout']:.2f} CPU-us/timeout, ratio {j['ratio']:.2f}")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
