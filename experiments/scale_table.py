"""MegaScale's 175B configuration at 1k-98k GPUs with jitter on every link and
device, where nothing reduces: ``megatronapp run`` and ``detect`` measured
against what the limits check estimated, and the simulation core against a
bare SimPy loop in the same process.

    python -m experiments.scale_table [--gpus 1024,12288,49152,98304] [--core-gpus 1024]
        [--detect-max-s S] [--keep-other-sizes] [--results-dir DIR]

Every job is scenarios/megascale_12288.yaml (tp 8, pp 8, interleaved with 6
chunks, 32 microbatches, one iteration) with dp = GPUs / 64, jitter on every
link (lognormal sigma 0.05) and every device (0.02), one GPU throttled to
1.3x and one pipeline link 10x slow at the same coordinates at every size
(3x, as the scenario file has it, costs 22 ms of an 8.4 s iteration, 0.26%:
under MegaScan's fitted ``min_share``, so that link is not named at any size).
Each command runs as a child pinned to one core; wall time, CPU time (user +
system) and peak resident memory come from the child's rusage. Before each
command the limits check's estimate is computed in a child of its own; a
command that the check refuses is reported with its estimate and not run;
with ``--detect-max-s S``, so is a ``detect`` estimated at more than S CPU
seconds (``run`` is still measured at that size). ``--keep-other-sizes``
keeps the rows of sizes not measured now from the results file as they are,
each with the command, commit and date that measured it.
The bare SimPy rate is measured by a child on the same core just before each
run. The core row times the compiled loop (set-up with its bulk draws, and
the loop) and a bare SimPy timeout loop alternately in one process, three
times each, keeping each one's best, CPU time per event.
Writes results/scale_table.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.render import markdown_table
from experiments.results import ROOT, read, results_dir_option, shown, start

SCENARIO = ROOT / "scenarios" / "megascale_12288.yaml"
TP, PP = 8, 8
JITTER = ["cluster.jitter.link_sigma=0.05", "cluster.jitter.compute_sigma=0.02"]


def faults_for(dp: int) -> str:
    """The 12,288-GPU scenario's faults moved to the same places of a job of ``dp`` replicas."""
    def rank(d: int, p: int, t: int) -> int:
        return t + TP * (d + dp * p)

    throttled = rank(dp * 49 // 192, 3, 0)
    a, b = rank(dp * 90 // 192, 5, 3), rank(dp * 90 // 192, 6, 3)
    return (f"[{{kind: throttle, rank: {throttled}, factor: 1.3}}, "
            f"{{kind: slow_link, ranks: [{a}, {b}], factor: 10.0}}]")


def overrides(gpus: int) -> list[str]:
    dp = gpus // (TP * PP)
    return [f"parallel.dp={dp}", f"faults={faults_for(dp)}", *JITTER]


def measured(cmd: list[str]) -> dict[str, Any]:
    """Wall, CPU (user + system) and peak RSS of one child process."""
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _pid, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - began
    out = proc.stdout.read() if proc.stdout else ""
    err = proc.stderr.read() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_gb": usage.ru_maxrss / 1e6, "stdout": out}


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
    e = limits.estimate_trace(trace_size(store).stored_events, 0, limits.COSTS.detect_columns,
                              batching(store.paths[0]))
fits = e.memory_bytes <= limits.available_memory() and e.seconds <= limits.DEFAULT_MAX_SECONDS
print(json.dumps({"events": e.events, "seconds": e.seconds, "memory_gb": e.memory_bytes / 1e9,
                  "fits": fits, "line": e.describe()}))
"""


def estimated(*args: str) -> dict[str, Any]:
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


def named(detect_stdout: str) -> list[str]:
    """The root causes ``detect --json`` names, in its order."""
    return [f"{c['kind']}:{c['rank']}" + (f"-{c['peer']}" if c.get("peer") is not None else "")
            for c in json.loads(detect_stdout)["root_causes"]]


def detect_allowed(estimate: dict[str, Any], max_s: float | None) -> bool:
    """Whether ``detect`` runs: its estimate fits the limits check and, given a
    budget, is within ``max_s`` CPU seconds."""
    return bool(estimate["fits"]) and (max_s is None or estimate["seconds"] <= max_s)


def one_size(gpus: int, workdir: Path, detect_max_s: float | None) -> dict[str, Any]:
    """``run`` then ``detect`` at ``gpus`` (each only where its estimate is allowed)."""
    run_dir = workdir / f"megascale_{gpus}"
    sets = overrides(gpus)
    row: dict[str, Any] = {"gpus": gpus, "run_estimate": estimated("run", str(SCENARIO), *sets)}
    if not row["run_estimate"]["fits"]:
        return row
    row["bare_timeouts_per_s"] = bare_rate()
    cli = [sys.executable, "-m", "megatronapp.cli"]
    run = measured(cli + ["run", str(SCENARIO), "--out", str(run_dir), "--quiet", "--no-limits",
                          *[a for x in sets for a in ("--set", x)]])
    trace = json.loads((run_dir / "summary.json").read_text())["trace"]
    row["run"] = {k: v for k, v in run.items() if k != "stdout"}
    row["events"] = trace["events"]
    row["trace_mb"] = (run_dir / "trace.parquet").stat().st_size / 1e6
    row["detect_estimate"] = estimated("detect", str(run_dir))
    if detect_allowed(row["detect_estimate"], detect_max_s):
        detect = measured(cli + ["detect", str(run_dir), "--json", "--no-limits"])
        row["detect"] = {k: v for k, v in detect.items() if k != "stdout"}
        row["named"] = named(detect["stdout"])
    shutil.rmtree(run_dir)  # the next size needs the disk
    return row


CORE = """
import json, sys, time
from megatronapp.run.jobs import compile_static
from megatronapp.scenario.config import load_scenario
from sim import bare_simpy_cpu_s_per_event
from sim.cluster import build_cluster
from sim.kernel_run import KernelRun
from sim.symmetry import pipe_classes
s = load_scenario(sys.argv[1], sys.argv[2:])
program = compile_static(s)
cores, bares = [], []
for _ in range(3):
    bares.append(bare_simpy_cpu_s_per_event())
    cluster = build_cluster(s)
    classes = pipe_classes(cluster)
    assert not classes.reduced, "jitter everywhere leaves nothing to reduce"
    began = time.process_time()
    KernelRun(cluster, program, classes).run()
    cores.append(time.process_time() - began)
events = program.events_per_pipe * len(classes.classes)
print(json.dumps({"events": events, "core_cpu_s": min(cores),
                  "core_us_per_event": min(cores) / events * 1e6,
                  "bare_us_per_timeout": min(bares) * 1e6}))
"""


def core_ratio(gpus: int) -> dict[str, Any]:
    """The compiled loop against a bare SimPy timeout, CPU time per event, in one child."""
    done = subprocess.run([sys.executable, "-c", CORE, str(SCENARIO), *overrides(gpus)],
                          cwd=ROOT, text=True, capture_output=True, check=True)
    out: dict[str, Any] = json.loads(done.stdout)
    out["gpus"] = gpus
    out["ratio"] = out["core_us_per_event"] / out["bare_us_per_timeout"]
    return out


def sizes_option(text: str) -> list[int]:
    """``--gpus``: GPU counts, each a whole number of 64-GPU pipelines (tp 8 x pp 8)."""
    try:
        sizes = [int(g) for g in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of whole numbers: {text!r}") from None
    if not sizes or any(g <= 0 or g % (TP * PP) for g in sizes):
        raise argparse.ArgumentTypeError(f"each must be a positive multiple of {TP * PP}: {text!r}")
    return sizes


def kept_rows(results_dir: Path, measured_now: set[int]) -> list[dict[str, Any]]:
    """The recorded rows of sizes not measured now, each with what measured it
    (the file's command, commit and date where the row does not say)."""
    try:
        doc = read("scale_table", results_dir)
    except FileNotFoundError:
        return []
    made = {"command": doc["command"], "commit": doc["commit"], "date": doc["date"]}
    return [{**r, "measured": r.get("measured", made)}
            for r in doc["data"]["rows"] if r["gpus"] not in measured_now]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.scale_table",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=sizes_option, default="1024,12288,49152,98304",
                        help="comma-separated GPU counts, each a multiple of 64")
    parser.add_argument("--core-gpus", type=int, default=1024)
    parser.add_argument("--detect-max-s", type=float, default=None,
                        help="run detect only where estimated at no more than this many CPU s")
    parser.add_argument("--keep-other-sizes", action="store_true",
                        help="keep the recorded rows of the sizes not measured now")
    results_dir_option(parser)
    args = parser.parse_args(argv)
    sizes: list[int] = args.gpus
    run = start("scale_table", argv)
    kept = kept_rows(args.results_dir, set(sizes)) if args.keep_other_sizes else []
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # children inherit one core
    rows = []
    (ROOT / "runs").mkdir(exist_ok=True)
    # the runs are GBs: on the repository's disk, in its ignored runs/ folder
    with tempfile.TemporaryDirectory(dir=ROOT / "runs") as tmp:
        for gpus in sizes:
            print(f"{gpus} GPUs ...", file=sys.stderr, flush=True)
            rows.append(one_size(gpus, Path(tmp), args.detect_max_s))
    if kept:
        # a row without "measured" was measured by this file's command and commit
        rows = sorted(kept + rows, key=lambda r: int(r["gpus"]))
    print("core ratio ...", file=sys.stderr, flush=True)
    path = run.record({"rows": rows, "core": core_ratio(args.core_gpus)}, args.results_dir)
    print(f"wrote {shown(path)}")
    for table in tables(json.loads(path.read_text())).values():
        print(table)


def _measure(row: dict[str, Any], what: str) -> tuple[str, str, str]:
    """CPU s, peak GB and events/s of ``run`` or ``detect`` beside the estimate."""
    est = row[f"{what}_estimate"]
    if what not in row:
        why = "refused: " if not est["fits"] else "not run: "
        return (f"{why}est. {est['seconds']:,.0f}", f"est. {est['memory_gb']:.1f}", "")
    m = row[what]
    return (f"{m['cpu_s']:,.1f} ({est['seconds']:,.0f})", f"{m['peak_gb']:.2f} ({est['memory_gb']:.1f})",
            f"{row['events'] / m['cpu_s'] / 1e6:.2f} M")


def tables(doc: dict[str, Any]) -> dict[str, str]:
    data = doc["data"]
    rows = []
    for r in data["rows"]:
        run_cpu, run_gb, run_rate = _measure(r, "run")
        detect_cpu, detect_gb, _rate = _measure(r, "detect") if "events" in r else ("", "", "")
        rows.append([f"{r['gpus']:,}", f"{r.get('events', r['run_estimate']['events']):,}",
                     run_cpu, run_gb, run_rate, detect_cpu, detect_gb,
                     " ".join(r.get("named", [])[:2]),
                     f"{r['bare_timeouts_per_s'] / 1e3:,.0f} k" if "bare_timeouts_per_s" in r else ""])
    scale = markdown_table(["GPUs", "events", "run CPU s (est.)", "run peak GB (est.)",
                            "run events/s (CPU)", "detect CPU s (est.)", "detect peak GB (est.)",
                            "detect names first", "bare SimPy timeouts/s"], rows, "rrrrrrrlr")
    c = data["core"]
    core = markdown_table(["GPUs", "events", "compiled loop CPU us/event", "bare SimPy CPU us/timeout",
                           "ratio"],
                          [[f"{c['gpus']:,}", f"{c['events']:,}", f"{c['core_us_per_event']:.3f}",
                            f"{c['bare_us_per_timeout']:.3f}", f"{c['ratio']:.2f}"]], "rrrrr")
    return {"scale": scale, "core": core}


if __name__ == "__main__":
    main()
