"""Measure what ``megatronapp run`` costs per trace event and per collective group
member, beside the constants ``megatronapp.host.limits.CostModel`` uses to refuse
jobs up front. Rerun after making the simulator faster and update the model.

    .venv/bin/python -m experiments.limits_calibration

Each row is one ``megatronapp run --no-limits`` in a subprocess: peak RSS and
CPU time from ``getrusage`` (wall time beside it: on a loaded machine CPU
time is the better measure), events and group members counted in its trace.
Slopes are taken between rows that differ in one dimension.

    .venv/bin/python -m experiments.limits_calibration --scan

measures the commands that read a trace (``detect``, ``analyze``, ``align``,
``plot``, ``export-trace``) on runs of a few sizes the same way: per stored
event (a run's ``trace.parquet``) and per byte of JSON trace text.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments import results
from megatronapp.host.limits import COSTS

ROOT = Path(__file__).resolve().parents[1]
BASE = {"iterations": 2, "model": {"layers": 8, "hidden": 256, "heads": 4, "seq_len": 256,
                                    "vocab": 1024}}
SHAPES = {  # name -> parallel section; pairs differ in events (m) or in group members (dp)
    "m16": {"tp": 2, "pp": 4, "dp": 4, "microbatches": 16},
    "m128": {"tp": 2, "pp": 4, "dp": 4, "microbatches": 128},
    "dp128": {"pp": 2, "dp": 128, "microbatches": 1},
    "dp1024": {"pp": 2, "dp": 1024, "microbatches": 1},
}
# A fresh parent per run, so that its children's peak RSS is this run's alone.
TIMED = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
         "stdout=subprocess.DEVNULL); r = resource.getrusage(resource.RUSAGE_CHILDREN); "
         "print(r.ru_utime + r.ru_stime, r.ru_maxrss * 1024)")


def measure(name: str, parallel: dict, work: Path) -> dict[str, float]:
    scenario = work / f"{name}.yaml"
    scenario.write_text(json.dumps({**BASE, "name": name, "parallel": parallel}))
    out = work / name
    start = time.perf_counter()
    timed = subprocess.run([sys.executable, "-c", TIMED, sys.executable, "-m", "megatronapp.cli",
                            "run", str(scenario), "--out", str(out), "--quiet", "--no-limits"],
                           check=True, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    cpu, rss = map(float, timed.stdout.split())
    events = [e for e in json.loads((out / "trace.json").read_text())["traceEvents"]
              if e["ph"] == "X"]
    disk = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {"events": len(events), "group": sum(len(e["args"].get("group", ())) for e in events),
            "cpu_s": cpu, "wall_s": wall, "rss": rss, "disk": float(disk)}


def slope(a: dict, b: dict, key: str, per: str, minus: float = 0.0) -> float:
    """d key / d per between two runs, after ``minus`` per event of the difference."""
    rest = (b[key] - a[key]) - minus * (b["events"] - a["events"])
    return rest / max(1.0, b[per] - a[per])


def run_main() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        rows = {name: measure(name, p, Path(tmp)) for name, p in SHAPES.items()}
    print(f"{'run':<8}{'events':>10}{'group members':>15}{'cpu s':>9}{'wall s':>9}"
          f"{'peak RSS MB':>13}{'disk MB':>9}")
    for name, r in rows.items():
        print(f"{name:<8}{r['events']:>10}{r['group']:>15}{r['cpu_s']:>9.2f}{r['wall_s']:>9.2f}"
              f"{r['rss'] / 1e6:>13.0f}{r['disk'] / 1e6:>9.1f}")
    ev, gr = (rows["m16"], rows["m128"]), (rows["dp128"], rows["dp1024"])
    print("\nmeasured slope (CPU) vs limits.CostModel")
    print(f"  seconds per event        {slope(*ev, 'cpu_s', 'events') * 1e6:8.1f} us   "
          f"model {COSTS.seconds_per_event * 1e6:.1f} us")
    print(f"  bytes per event          {slope(*ev, 'rss', 'events'):8.0f} B    "
          f"model {COSTS.bytes_per_event:.0f} B (peak RSS, a conservative bound)")
    print(f"  disk bytes per event     {slope(*ev, 'disk', 'events'):8.0f} B    "
          f"model {COSTS.disk_bytes_per_event:.0f} B")
    per_event_s, per_event_b = slope(*ev, "cpu_s", "events"), slope(*ev, "rss", "events")
    print(f"  seconds per group member {slope(*gr, 'cpu_s', 'group', per_event_s) * 1e6:8.2f} us"
          f"   model {COSTS.seconds_per_group_entry * 1e6:.2f} us")
    print(f"  bytes per group member   {slope(*gr, 'rss', 'group', per_event_b):8.1f} B    "
          f"model {COSTS.bytes_per_group_entry:.1f} B")
    return {"base": BASE, "shapes": SHAPES, "rows": rows}


# ------------------------------------------------ commands that read a trace
SCAN_SHAPES = {"m4": 4, "m16": 16, "m64": 64, "m256": 256}  # microbatches of m16's job
JSON_SHAPES = ("m4", "m16")  # small: drawing the timeline takes milliseconds per event
STORE_SHAPES = ("m16", "m64", "m256")
SCAN_COMMANDS = {  # name -> (argv after the run directory, what it reads)
    "detect": (["detect", "{run}"], "store"),
    "analyze": (["analyze", "{run}"], "store"),
    "align": (["align", "{run}", "--out", "{work}/aligned.json"], "store"),
    "export-trace": (["export-trace", "{run}", "--out", "{work}/export.json"], "store"),
    "detect json": (["detect", "{run}/trace.json"], "json"),
    "plot": (["plot", "{run}"], "json"),
}


def timed(argv: list[str]) -> tuple[float, float]:
    """(CPU seconds, peak RSS bytes) of one ``megatronapp`` command."""
    done = subprocess.run([sys.executable, "-c", TIMED, sys.executable, "-m", "megatronapp.cli",
                           *argv, "--no-limits"], check=True, cwd=ROOT, capture_output=True,
                          text=True)
    cpu, rss = map(float, done.stdout.split())
    return cpu, rss


def scan_rows(work: Path) -> list[dict[str, float | str]]:
    rows: list[dict[str, float | str]] = []
    for name, microbatches in SCAN_SHAPES.items():
        run = work / name
        scenario = work / f"{name}.yaml"
        scenario.write_text(json.dumps({**BASE, "name": name, "parallel": {
            **SHAPES["m16"], "microbatches": microbatches}}))
        subprocess.run([sys.executable, "-m", "megatronapp.cli", "run", str(scenario), "--out",
                        str(run), "--quiet", "--no-limits"], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
        # every rank's events (a symmetric run stores only its representatives' rows)
        events = json.loads((run / "summary.json").read_text())["trace"]["events"]
        text = (run / "trace.json").stat().st_size if name in JSON_SHAPES else 0
        for command, (argv, reads) in SCAN_COMMANDS.items():
            if name not in (JSON_SHAPES if reads == "json" else STORE_SHAPES):
                continue
            cpu, rss = timed([a.format(run=run, work=work) for a in argv])
            rows.append({"command": command, "run": name, "events": events, "text": text,
                         "cpu_s": cpu, "rss": rss})
    return rows


def scan_main() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        rows = scan_rows(Path(tmp))
    print(f"{'command':<14}{'run':<6}{'events':>9}{'JSON MB':>9}{'cpu s':>8}{'peak RSS MB':>13}")
    for r in rows:
        print(f"{r['command']:<14}{r['run']:<6}{r['events']:>9}{float(r['text']) / 1e6:>9.1f}"
              f"{r['cpu_s']:>8.2f}{float(r['rss']) / 1e6:>13.0f}")
    print("\nslopes between the two largest runs of each command (per event; per JSON byte)")
    for command in SCAN_COMMANDS:
        mine = [r for r in rows if r["command"] == command]
        a, b = mine[-2], mine[-1]
        d_events = float(b["events"]) - float(a["events"])
        d_text = max(1.0, float(b["text"]) - float(a["text"]))
        line = (f"  {command:<14}{(float(b['rss']) - float(a['rss'])) / d_events:8.0f} B/event "
                f"{(float(b['cpu_s']) - float(a['cpu_s'])) / d_events * 1e6:8.1f} us/event")
        if b["text"]:
            line += f" {(float(b['rss']) - float(a['rss'])) / d_text:6.1f} B per JSON byte"
        print(line)
    print("  model (limits.CostModel): " + ", ".join(
        f"{name} {cost.bytes_per_event:.0f} B {cost.seconds_per_event * 1e6:.1f} us"
        for name, cost in (("detect (columns)", COSTS.detect_columns),
                           ("detect (objects)", COSTS.detect_events), ("analyze", COSTS.analyze),
                           ("align", COSTS.align), ("export-trace", COSTS.export),
                           ("plot", COSTS.plot))))
    print(f"  JSON: {COSTS.json_bytes_per_event:.0f} B per event, "
          f"{COSTS.json_memory_per_byte:.1f} B of memory per byte parsed")
    return {"base": BASE, "shapes": SCAN_SHAPES, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    options = results.parser("limits_calibration", __doc__)
    options.add_argument("--scan", action="store_true",
                         help="the commands that read a trace, not `megatronapp run`")
    results.results_dir_option(options)
    args = options.parse_args(argv)
    experiment = results.start("limits_calibration", argv)
    part, data = ("scan", scan_main()) if args.scan else ("run", run_main())
    print(f"wrote {experiment.record_part(part, data, args.results_dir)}")


if __name__ == "__main__":
    main()
