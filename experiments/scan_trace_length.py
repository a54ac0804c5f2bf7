"""How MegaScan's accuracy depends on how many iterations a trace holds:
every run of a recorded set scored as if its profiler had traced only its
first K steps (``--steps``), for each K, with MegaScan, MegaScan judging a
fault persistent only where it counts in every iteration (``chance_count``
1), and the HTA-style baseline. A run's eligibility (``sets.eligible``) is
its whole trace's.

    python -m experiments.scan_trace_length tests/data/steps12 [...] [--steps 2 4 8 12]

Writes ``results/scan_trace_length.json`` and ``docs/img/scan_trace_length.png``.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Sequence

from experiments import results
from experiments.render import markdown_table

NAME = "scan_trace_length"
STEP = re.compile(r"ProfilerStep#(\d+)")
EVERY = "megascan, every iteration"
METHODS = ("megascan", EVERY, "hta-latest")
FIGURE = results.ROOT / "docs" / "img" / "scan_trace_length.png"


def first_steps(trace: dict[str, Any], steps: int) -> dict[str, Any]:
    """``trace`` as if it had been traced for its first ``steps`` profiler
    steps: every timed event that starts after the last of them ends is left out."""
    ends: dict[int, float] = {}
    for e in trace["traceEvents"]:
        found = STEP.fullmatch(str(e.get("name", "")))
        if found and e.get("ph") == "X":
            n = int(found.group(1))
            ends[n] = max(ends.get(n, float("-inf")), float(e["ts"]) + float(e["dur"]))
    numbers = sorted(ends)
    if len(numbers) <= steps:
        return trace
    cut = ends[numbers[steps - 1]]
    kept = [e for e in trace["traceEvents"] if "ts" not in e or float(e["ts"]) < cut]
    return {**trace, "traceEvents": kept}


def truncated_run(run_dir: Path, steps: int, into: Path) -> Path:
    """A copy of a run's trace files in ``into``, each read as MegaScan reads
    it and cut to its first ``steps`` steps."""
    from megatronapp.scan.ingest.kineto import read_json_any

    into.mkdir(parents=True)
    for path in sorted(run_dir.glob("*.pt.trace.json*")):
        name = path.name if path.suffix == ".gz" else path.name + ".gz"
        with gzip.open(into / name, "wt") as f:
            json.dump(first_steps(read_json_any(path), steps), f)
    return into


def verdicts(folders: Sequence[Path], steps: Sequence[int], say: Any
             ) -> dict[int, dict[str, list[Any]]]:
    """Per K and method, each run's outcome."""
    from megatronapp.io.outdirs import scratch_folder
    from megatronapp.scan.align.inputs import load_scan_input
    from megatronapp.scan.eval import sets
    from megatronapp.scan.eval.tuning import outcome_of
    from megatronapp.scan.evidence.detect import megascan, op_members
    from megatronapp.scan.evidence.params import Params
    from megatronapp.scan.methods import detector

    every = replace(Params(), chance_count=1.0)
    methods = {m: detector(m) for m in METHODS if m != EVERY}
    methods[EVERY] = lambda scan: megascan(scan, every)

    out: dict[int, dict[str, list[Any]]] = {k: {m: [] for m in METHODS} for k in steps}
    runs = [(folder, run) for folder in folders for run in sets.recorded(folder, "tuning-zoo")]
    with scratch_folder("megatronapp-trace-length-") as tmp:
        for i, (folder, run) in enumerate(runs, 1):
            for k in steps:
                scan = load_scan_input(truncated_run(folder / run.name, k, tmp / f"{i}-{k}"))
                _, pairs = op_members(scan)
                for m in METHODS:
                    found = methods[m](scan)
                    out[k][m].append(outcome_of(run, found.root_causes, frozenset(pairs)))
            say(f"{i}/{len(runs)} {run.name}")
    return out


def summary(outcomes: Iterable[Any]) -> dict[str, Any]:
    counted = [o for o in outcomes if o.run.eligible]
    faulted = [o for o in counted if o.faulted]
    healthy = [o for o in counted if not o.faulted]
    by_category: dict[str, Counter[str]] = {}
    for o in faulted:
        by_category.setdefault(o.run.category, Counter())[o.verdict] += 1
    return {"faulted": len(faulted), "named_first": sum(o.verdict == "right" for o in faulted),
            "healthy": len(healthy),
            "false_alarms": sum(o.verdict == "false alarm" for o in healthy),
            "categories": {c: dict(v) for c, v in sorted(by_category.items())}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m experiments.{NAME}",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("sets", type=Path, nargs="+",
                        help="recorded sets (folders with manifest.json), scored together")
    parser.add_argument("--steps", type=int, nargs="+", default=[2, 4, 8, 12])
    args = parser.parse_args(argv)
    if any(k < 1 for k in args.steps):
        print(f"{NAME}: --steps: each must be >= 1, got {args.steps}", file=sys.stderr)
        return 2
    for folder in args.sets:
        if not (folder / "manifest.json").is_file():
            print(f"{NAME}: sets: {folder} holds no manifest.json", file=sys.stderr)
            return 2
    run = results.start(NAME)
    found = verdicts(args.sets, args.steps, lambda text: print(text, file=sys.stderr, flush=True))
    data = {"sets": [str(f) for f in args.sets],
            "steps": {str(k): {m: summary(v) for m, v in by.items()} for k, by in found.items()}}
    path = run.record(data)
    plot(data, FIGURE)
    print(f"wrote {path} and {FIGURE}")
    return 0


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(data["steps"], key=int)
    fig, (named, alarms) = plt.subplots(1, 2, figsize=(8, 3.4))
    for m, marker in zip(METHODS, "os^"):
        per = [data["steps"][k][m] for k in steps]
        named.plot([int(k) for k in steps], [100 * s["named_first"] / max(s["faulted"], 1)
                                             for s in per], marker=marker, label=m)
        alarms.plot([int(k) for k in steps], [100 * s["false_alarms"] / max(s["healthy"], 1)
                                              for s in per], marker=marker, label=m)
    named.set_ylabel("faults named first (%)")
    alarms.set_ylabel("healthy runs with a false alarm (%)")
    for ax in (named, alarms):
        ax.set_xlabel("profiler steps traced")
        ax.set_xticks([int(k) for k in steps])
        ax.set_ylim(0, 100)
    named.legend(fontsize=8)
    fig.suptitle("Accuracy against a trace's length (the same runs, cut to their first steps)",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pct(k: int, n: int) -> str:
    return f"{k}/{n} ({100 * k / n:.0f}%)" if n else "-"


def tables(doc: dict[str, Any]) -> dict[str, str]:
    """One row per number of steps traced: each method's faults named first and false alarms."""
    steps = doc["data"]["steps"]
    methods = list(next(iter(steps.values())))
    rows = [[k, *[f"{_pct(s['named_first'], s['faulted'])}, {_pct(s['false_alarms'], s['healthy'])}"
                  for s in (steps[k][m] for m in methods)]]
            for k in sorted(steps, key=int)]
    return {"length": markdown_table(["steps traced", *[f"{m}: named first, false alarms"
                                                         for m in methods]],
                                     rows, "r" + "r" * len(methods))}


if __name__ == "__main__":
    sys.exit(main())
