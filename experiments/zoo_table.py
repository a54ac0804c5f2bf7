"""MegaScan and its baselines on the traces ordinary PyTorch jobs write.

Each job of ``tests/zoo`` (4 ranks, gloo, CPU profiler with the default
``record_shapes=False``) runs healthy, with rank 1's own matmuls 1.5x and
2x bigger, and, where the job has point-to-point of its own, with a slow
link (rank 2 sleeps 5 ms before each ``wait()`` on a receive from rank 1 and
rank 1 likewise from rank 2); then ``megatronapp detect DIR --json`` runs
with every ``--method``. A method's verdict on one run is

- right: healthy and no root cause, or its most confident root cause is
  the injected one (compute on the slowed rank, or the slowed link);
- missed: a fault and no root cause;
- wrong: a fault and another root cause first;
- false alarm: healthy and a root cause;
- phantom (counted besides): a named link between ranks that exchange no
  point-to-point message in the job (in jobs with collectives only, every
  pair shares the world group, so no link there is a phantom).

Realized slowdown, read from the trace, not from the option
(``tests/zoo/measure.py``): each rank's compute is the summed duration of its
``aten::mm`` / ``aten::addmm`` / ``aten::bmm`` cpu_ops (every matmul of
forward and backward; nothing else in these jobs computes much); the slowed
rank's compute over the median of its peers'. For a run without a slowed rank the column shows the largest
such ratio over the ranks (what the machine's own noise makes of a healthy
job). The ``megatron-core-profile`` job (Megatron-core through this
project's torch backend with ``--profile``, see ``MEGATRON``) has its
faults from the scenario; its compute is its ``forward`` / ``backward``
ranges (which hold the throttle's sleep), compared among the middle stages
only (the end stages also hold the embedding and the output layer). Runs go round the whole grid once per ``--runs``, so a cut-short run
of the script still covers every case alike (``--out`` is rewritten after
every run; ``--table-from`` prints the table of such a file).

    .venv/bin/python -m experiments.zoo_table --runs 5 --out zoo.json
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tempfile

import yaml
from collections import Counter
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments import results
from megatronapp.cli import main as cli_main
from megatronapp.errors import UserError
from megatronapp.io.outdirs import add_force_option, check_file, new_file
from megatronapp.scan.methods import DETECTORS
from tests.zoo.measure import compute_seconds, realized_slowdown, work_range_seconds

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "tests" / "zoo"
WORLD, SLOW_RANK, SLOW_LINK, DELAY_MS = 4, 1, (1, 2), 5.0
PIPELINE_LINKS = frozenset(frozenset((s, s + 1)) for s in range(WORLD - 1))
VERDICTS = ("right", "wrong", "missed", "false alarm", "error")


@dataclass(frozen=True)
class Kind:
    script: str  # a job of tests/zoo, or MEGATRON
    flags: tuple[str, ...] = ()
    p2p: frozenset[frozenset[int]] = frozenset()  # rank pairs with point-to-point
    slow_link: bool = False  # the job's own receives can be slowed
    alike: tuple[int, ...] | None = None  # the ranks doing the same work (None: all)


@dataclass(frozen=True)
class Fault:
    label: str
    flags: tuple[str, ...]
    expected: tuple[str, int, int | None] | None  # (kind, rank, peer) of the root cause
    needs_link: bool = False
    factor: float = 1.0  # the slowed rank's


# Megatron-core through this project's torch backend, profiled: ``megatronapp
# run SCENARIO --backend torch --profile``, a tiny GPT in 4 pipeline stages
# (one layer each; the first also holds the embedding, the last the output
# layer and the loss) on gloo; ``detect`` reads its torch.profiler directory
# (``RUN/profile``), not the run's own trace. Faults come from the scenario:
# a throttle (the rank sleeps (F-1)x each compute op's work inside the op's
# range) and a slow link (its receiver sleeps once the receive is done:
# factor 1 + D / the scenario's fixed point-to-point time).
MEGATRON = "megatronapp-run"
MEGATRON_P2P_S = 1e-3
MEGATRON_SCENARIO: dict[str, Any] = {
    "name": "zoo-megatron", "seed": 1, "iterations": 6, "schedule": "1f1b",
    "parallel": {"tp": 1, "pp": WORLD, "dp": 1, "microbatches": 8},
    "model": {"layers": WORLD, "hidden": 128, "heads": 4, "seq_len": 64, "vocab": 256,
              "micro_batch_size": 4},
    "training": {"precision": "fp32"}, "costs": {"p2p_s": MEGATRON_P2P_S}}


KINDS = {
    "ddp": Kind("ddp_mlp.py"),
    "ddp-annotated": Kind("ddp_mlp.py", ("--annotate",)),
    "fsdp2": Kind("fsdp2_mlp.py"),
    "pipeline-1f1b": Kind("pipeline_1f1b.py", p2p=PIPELINE_LINKS, slow_link=True),
    "pipelining-1f1b": Kind("pipelining_1f1b.py", p2p=PIPELINE_LINKS),
    "allreduce-uneven": Kind("allreduce_uneven.py"),
    "tp-mlp": Kind("tp_mlp.py"),
    # the same jobs profiled otherwise: which settings help the diagnosis
    "pipeline-1f1b+shapes": Kind("pipeline_1f1b.py", ("--record-shapes",), PIPELINE_LINKS, True),
    "fsdp2+shapes": Kind("fsdp2_mlp.py", ("--record-shapes",)),
    "ddp-annotated-no-steps": Kind("ddp_mlp.py", ("--annotate", "--no-profiler-steps")),
    "megatron-core-profile": Kind(MEGATRON, p2p=PIPELINE_LINKS, slow_link=True,
                                  alike=tuple(range(1, WORLD - 1))),
}
FAULTS = (
    Fault("healthy", (), None),
    *(Fault(f"rank {SLOW_RANK} x{f}", ("--slow-rank", str(SLOW_RANK), "--factor", str(f)),
            ("compute", SLOW_RANK, None), factor=f) for f in (1.5, 2.0)),
    Fault(f"link {SLOW_LINK[0]}-{SLOW_LINK[1]} +{DELAY_MS:g} ms",
          ("--slow-link", *map(str, SLOW_LINK), "--delay-ms", str(DELAY_MS)),
          ("link", *SLOW_LINK), needs_link=True),
)


# ------------------------------------------------------------- one run
def run_job(kind: Kind, fault: Fault, out: Path) -> Path:
    """Run the job with the fault; the folder of its torch.profiler traces."""
    if kind.script == MEGATRON:
        return run_megatron(fault, out)
    command = [sys.executable, str(ZOO / kind.script), "--out", str(out),
               "--world", str(WORLD), *kind.flags, *fault.flags]
    subprocess.run(command, check=True, capture_output=True, timeout=900)
    return out


def run_megatron(fault: Fault, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    scenario = out / "scenario.yaml"
    scenario.write_text(yaml.safe_dump({**MEGATRON_SCENARIO, "faults": scenario_faults(fault)}))
    command = [sys.executable, "-m", "megatronapp.cli", "run", str(scenario), "--backend", "torch",
               "--profile", "--quiet", "--out", str(out / "run")]
    subprocess.run(command, check=True, capture_output=True, timeout=900, cwd=ROOT)
    return out / "run" / "profile"


def scenario_faults(fault: Fault) -> list[dict[str, Any]]:
    """The fault as the scenario's ``faults``."""
    if fault.expected is None:
        return []
    kind, rank, peer = fault.expected
    if kind == "compute":
        return [{"kind": "throttle", "rank": rank, "factor": fault.factor}]
    return [{"kind": "slow_link", "ranks": [rank, peer],
             "factor": 1.0 + DELAY_MS / 1e3 / MEGATRON_P2P_S}]


def detect(out: Path, method: str) -> dict[str, Any]:
    """``megatronapp detect OUT --json --method METHOD``: its JSON, or its error."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        status = cli_main(["detect", str(out), "--json", "--method", method])
    if status != 0:
        return {"error": stderr.getvalue().strip()}
    return dict(json.loads(stdout.getvalue()))


def verdict(expected: tuple[str, int, int | None] | None, answer: dict[str, Any]) -> str:
    if "error" in answer:
        return "error"
    causes = [(c["kind"], c["rank"], c["peer"]) for c in answer["root_causes"]]
    if expected is None:
        return "false alarm" if causes else "right"
    if not causes:
        return "missed"
    return "right" if same_cause(causes[0], expected) else "wrong"


def same_cause(found: tuple[str, int, int | None], expected: tuple[str, int, int | None]) -> bool:
    if found[0] != expected[0]:
        return False
    if found[0] == "compute":
        return found[1] == expected[1]
    return {found[1], found[2]} == {expected[1], expected[2]}


def phantom_links(kind: Kind, answer: dict[str, Any]) -> list[list[int]]:
    if not kind.p2p:
        return []
    return [[c["rank"], c["peer"]] for c in answer.get("root_causes", ())
            if c["kind"] == "link" and frozenset((c["rank"], c["peer"])) not in kind.p2p]


def one_run(name: str, kind: Kind, fault: Fault, methods: list[str],
            keep: Path | None = None) -> dict[str, Any]:
    """One job run and every method's verdict on its traces; with ``keep``
    the traces stay in a fresh folder under it (``--rescore`` reads them)."""
    if keep:
        return run_in(Path(tempfile.mkdtemp(prefix="zoo-", dir=keep)), name, kind, fault,
                      methods, kept=True)
    with tempfile.TemporaryDirectory(prefix="zoo-") as tmp:
        return run_in(Path(tmp), name, kind, fault, methods)


def run_in(out: Path, name: str, kind: Kind, fault: Fault, methods: list[str],
           kept: bool = False) -> dict[str, Any]:
    traces = run_job(kind, fault, out)
    slow = fault.expected[1] if fault.expected and fault.expected[0] == "compute" else None
    seconds = work_range_seconds(traces) if kind.script == MEGATRON else compute_seconds(traces)
    record: dict[str, Any] = {
        "kind": name, "fault": fault.label,
        "realized": realized_slowdown(seconds, slow, kind.alike), "methods": {}}
    if kept:
        record["trace"] = str(traces)
    score(record, methods, traces)
    return record


def score(record: dict[str, Any], methods: list[str], out: Path) -> None:
    """Every method's verdict on the traces in ``out``, into ``record``."""
    fault = next(f for f in FAULTS if f.label == record["fault"])
    for method in methods:
        answer = detect(out, method)
        record["methods"][method] = {
            "verdict": verdict(fault.expected, answer),
            "phantom": phantom_links(KINDS[record["kind"]], answer),
            "root_causes": [(c["kind"], c["rank"], c["peer"])
                            for c in answer.get("root_causes", ())]}


# ------------------------------------------------------------- the table
def cell(runs: list[dict[str, Any]]) -> str:
    counts = Counter(r["verdict"] for r in runs)
    text = ", ".join(f"{v} {counts[v]}" for v in VERDICTS if counts[v])
    phantoms = sum(1 for r in runs if r["phantom"])
    return text + (f" (phantom link in {phantoms})" if phantoms else "")


def table(records: list[dict[str, Any]], methods: list[str]) -> str:
    cases: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in records:
        cases.setdefault((record["kind"], record["fault"]), []).append(record)
    lines = ["| job | fault | runs | realized slowdown, median (min-max) | "
             + " | ".join(methods) + " |", "|---" * (4 + len(methods)) + "|"]
    for (kind, fault), runs in cases.items():
        realized = [r["realized"] for r in runs]
        span = f"{statistics.median(realized):.2f} ({min(realized):.2f}-{max(realized):.2f})"
        verdicts = [cell([r["methods"][m] for r in runs]) for m in methods]
        lines.append(f"| {kind} | {fault} | {len(runs)} | {span} | " + " | ".join(verdicts) + " |")
    return "\n".join(lines)


GOAL_SLOWDOWN = 1.5  # issue 20: every slowed rank at least this slow by its trace named first


def goal(records: list[dict[str, Any]], methods: list[str]) -> str:
    """Per method, against the goal: slowed ranks with a realized slowdown of
    ``GOAL_SLOWDOWN`` or more named first, slow links named first, false
    alarms on healthy runs, runs naming a link the job never used."""
    slowed = [r for r in records if r["fault"].startswith("rank") and r["realized"] >= GOAL_SLOWDOWN]
    links = [r for r in records if r["fault"].startswith("link")]
    healthy = [r for r in records if r["fault"] == "healthy"]
    lines = []
    for m in methods:
        def right(runs: list[dict[str, Any]]) -> int:
            return sum(r["methods"][m]["verdict"] == "right" for r in runs)
        phantoms = sum(1 for r in records if r["methods"][m]["phantom"])
        lines.append(f"{m}: slowed ranks (realized >= {GOAL_SLOWDOWN}x) named first "
                     f"{right(slowed)} of {len(slowed)}; slow links named first "
                     f"{right(links)} of {len(links)}; false alarms "
                     f"{len(healthy) - right(healthy)} of {len(healthy)} healthy; "
                     f"phantom links in {phantoms} of {len(records)} runs")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=list(KINDS))
    parser.add_argument("--faults", nargs="+", choices=[f.label for f in FAULTS],
                        default=[f.label for f in FAULTS])
    parser.add_argument("--methods", nargs="+", choices=sorted(DETECTORS), default=list(DETECTORS))
    parser.add_argument("--out", type=Path, help="every run's record as JSON")
    parser.add_argument("--table-from", type=Path, help="print the table of an --out file")
    parser.add_argument("--keep", type=Path,
                        help="keep each run's traces in a folder under this one")
    parser.add_argument("--rescore", type=Path,
                        help="score an --out file's kept traces again (into --out, if given)")
    add_force_option(parser, "an existing --out file")
    results.results_dir_option(parser)
    return parser.parse_args(argv)


def save_records(path: Path, records: list[dict[str, Any]], force: bool,
                 inputs: list[Path]) -> None:
    """``--out`` written whole or not at all; an existing file only with
    ``--force`` (or the one this run wrote before), never one of the inputs."""
    with new_file(path, "--out", force=force, inputs=inputs) as tmp:
        tmp.write_text(json.dumps(records, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    inputs = [p for p in (args.rescore, args.table_from) if p is not None]
    try:
        if args.out:  # before any run: a refusal should not wait for the jobs
            check_file(args.out, "--out", args.force, inputs)
        return run_or_rescore(args, inputs, results.start("zoo_table", argv))
    except UserError as err:
        print(f"zoo_table.py: {err}", file=sys.stderr)
        return 2


def report(args: argparse.Namespace, records: list[dict[str, Any]],
           experiment: results.Run) -> int:
    """Print the table and the goal line; record them with every run's record."""
    rows, verdicts = table(records, args.methods), goal(records, args.methods)
    print(rows + "\n\n" + verdicts)
    recorded = experiment.record(
        {"methods": args.methods, "from": str(args.table_from or args.rescore or "runs"),
         "cells": results.Printed([rows]).cells(), "goal": verdicts.splitlines(),
         "records": records}, args.results_dir)
    print(f"wrote {recorded}")
    return 0


def run_or_rescore(args: argparse.Namespace, inputs: list[Path], experiment: results.Run) -> int:
    if args.table_from:
        return report(args, json.loads(args.table_from.read_text()), experiment)
    if args.rescore:
        return rescore(args, inputs, experiment)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    cases = [(name, fault) for name in args.kinds for fault in FAULTS
             if (KINDS[name].slow_link or not fault.needs_link) and fault.label in args.faults]
    records: list[dict[str, Any]] = []
    for run in range(args.runs):
        for i, (name, fault) in enumerate(cases, 1):
            print(f"run {run + 1}/{args.runs}, case {i}/{len(cases)}: {name}, {fault.label}",
                  file=sys.stderr, flush=True)
            records.append(one_run(name, KINDS[name], fault, args.methods, args.keep))
            if args.out:  # after the first run the file there is this run's own
                save_records(args.out, records, args.force or len(records) > 1, inputs)
    return report(args, records, experiment)


def rescore(args: argparse.Namespace, inputs: list[Path], experiment: results.Run) -> int:
    """The ``--methods``' verdicts again on the kept traces of ``--rescore``'s
    records (the same runs judged by this version's detector; other methods'
    verdicts are kept)."""
    records = json.loads(args.rescore.read_text())
    for record in records:
        score(record, args.methods, Path(record["trace"]))
    if args.out:
        save_records(args.out, records, args.force, inputs)
    return report(args, records, experiment)


if __name__ == "__main__":
    sys.exit(main())
