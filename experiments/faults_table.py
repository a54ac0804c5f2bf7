"""The fault kinds real jobs suffer, each in simulation and on the torch
backend: what was injected, what the run realised, and what MegaScan named
(through its public entry points: ``megatronapp.scan.methods.detector`` on a
run directory as ``megatronapp scan`` loads it, so the table follows
whichever detector is installed).

    python -m experiments.faults_table [--seeds 10] [--backends sim,torch] [--kinds K,K]
                                       [--keep DIR] [--rescore DIR]

Per kind and backend, ``--seeds`` runs of one job, the fault placed and timed
by the seed in units of the job's healthy iteration time ``T`` (one healthy
run per backend). Realised effects are measured inside the faulty run where
they can be (a stalled iteration against the rank's others), against a
healthy twin of the same seed where they cannot (a flapping link). Real runs
take a minute each on a loaded 2-core machine, so ``--kinds`` runs some kinds
(by kind name) and keeps the others' rows of the results file, each part
with its own date, load and command.

Every faulty run's directory is written under ``--keep`` (default
``runs/faults_table``) and scored from there; ``--rescore DIR`` scores the
runs kept in DIR again with the installed detector, running nothing, so a
changed MegaScan refreshes the verdicts in seconds.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from experiments import results
from experiments.render import markdown_table

NAME = "faults_table"
SIM_JOB: dict[str, Any] = {"iterations": 6, "schedule": "1f1b",
           "parallel": {"tp": 1, "pp": 4, "dp": 2, "microbatches": 8},
           "model": {"layers": 8, "hidden": 1024, "heads": 16, "seq_len": 1024},
           "cluster": {"jitter": {"compute_sigma": 0.02, "link_sigma": 0.05}}}
TORCH_JOB: dict[str, Any] = {"iterations": 6, "schedule": "1f1b",
             "parallel": {"tp": 1, "pp": 2, "dp": 2, "microbatches": 4},
             "model": {"layers": 4, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 64,
                       "micro_batch_size": 2},
             "costs": {"p2p_s": 0.002}}
JOBS = {"sim": SIM_JOB, "torch": TORCH_JOB}
TORCH_STALL_TIMEOUT_S = 180.0

Measure = Callable[[Any, Any, Any], tuple[float, float]]  # (scenario, run, twin) -> both


@dataclass(frozen=True)
class Case:
    label: str
    unit: str  # of the injected and realised numbers
    fault: Callable[[np.random.Generator, Any, float], dict[str, Any]]  # rng, topology, T
    measure: Measure
    twin: bool = False  # needs the healthy run of the same seed


# --------------------------------------------------------- measurements
def _ops(events: list[Any]) -> list[Any]:
    """The ops, not the iteration ranges a backend marks (kind "other")."""
    return [e for e in events if e.args.get("kind") != "other"]


def _events(run: Any, rank: int) -> list[Any]:
    return sorted(_ops(run.events[rank]), key=lambda e: e.start_s)


def _first_forward_gaps(run: Any, rank: int) -> dict[int, float]:
    """Per iteration: the rank's idle time before its first forward."""
    events, gaps = _events(run, rank), {}
    for i, e in enumerate(events):
        it = e.args.get("iteration", -1)
        if e.name == "forward" and it not in gaps and i > 0:
            gaps[it] = e.start_s - max(p.start_s + p.dur_s for p in events[:i])
    return gaps


def _forwards(run: Any, rank: int) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for e in run.events[rank]:
        if e.name == "forward":
            out.setdefault(e.args["iteration"], []).append(e.dur_s)
    return out


def _hit(fault: dict[str, Any], iteration: int) -> bool:
    k = fault.get("every_k_iterations", 1)
    return iteration % k == k - 1


def measure_stall(s: Any, run: Any, _twin: Any) -> tuple[float, float]:
    fault = s.faults[0]
    gaps = _first_forward_gaps(run, fault.rank)
    hit = [g for it, g in gaps.items() if _hit(fault.model_dump(), it)]
    calm = [g for it, g in gaps.items() if not _hit(fault.model_dump(), it) and it > 0]
    return fault.seconds, statistics.median(hit) - statistics.median(calm)


def measure_throttle(s: Any, run: Any, _twin: Any) -> tuple[float, float]:
    fault = s.faults[0]
    by_it = _forwards(run, fault.rank)
    hit = [d for it, ds in by_it.items() if _hit(fault.model_dump(), it) for d in ds]
    calm = [d for it, ds in by_it.items() if not _hit(fault.model_dump(), it) and it > 0
            for d in ds]
    return fault.factor, statistics.median(hit) / statistics.median(calm)


def _end_s(run: Any) -> float:
    return max(e.start_s + e.dur_s for events in run.events.values() for e in _ops(events))


def _start_s(run: Any) -> float:
    return min(e.start_s for events in run.events.values() for e in _ops(events))


def measure_flap(s: Any, run: Any, twin: Any) -> tuple[float, float]:
    """The outage time of the drops inside the job, against the time it lost."""
    outage = s.faults[0].outage
    drops = [t for t in outage.downs(_end_s(twin)) if t + outage.down_s > _start_s(twin)]
    injected = len(drops) * (outage.down_s + outage.retry_s)
    return injected, (_end_s(run) - _start_s(run)) - (_end_s(twin) - _start_s(twin))


def measure_crash(s: Any, run: Any, _twin: Any) -> tuple[float, float]:
    """When the rank was to die, against the end of its last recorded op (none
    when it died before its first iteration's events were handed over)."""
    fault = s.faults[0]
    return fault.at_s, max((e.start_s + e.dur_s for e in _ops(run.events[fault.rank])),
                           default=math.nan)


def measure_variation(s: Any, run: Any, _twin: Any) -> tuple[float, float]:
    """The slowest device's drawn factor over the median draw of its pipeline
    stage (ranks of one stage do the same work), against its median forward
    over the median of its stage's."""
    from megatronapp.program.layout import topology_of
    from megatronapp.scenario.config import fault_job

    factors = s.faults[0].factors(fault_job(s))
    slowest = int(np.argmax(factors))
    topo = topology_of(s)
    stage = [r for r in range(topo.world_size) if topo.coord(r).pp == topo.coord(slowest).pp]
    medians = {r: statistics.median(d for ds in _forwards(run, r).values() for d in ds)
               for r in stage}
    return (float(factors[slowest] / np.median(factors[stage])),
            medians[slowest] / statistics.median(medians.values()))


def measure_nothing(_s: Any, _run: Any, _twin: Any) -> tuple[float, float]:
    """A healthy control: nothing injected, nothing to realise."""
    return 0.0, 0.0


# ---------------------------------------------------------------- cases
def _rank(rng: np.random.Generator, topo: Any) -> int:
    return int(rng.integers(topo.world_size))


def _pipeline_pair(rng: np.random.Generator, topo: Any) -> list[int]:
    a = int(rng.choice([r for r in range(topo.world_size) if topo.coord(r).pp < topo.pp - 1]))
    return [a, topo.pp_neighbor(a, 1)]


CASES = (
    Case("host_stall", "s", lambda rng, topo, t: {
        "kind": "host_stall", "rank": _rank(rng, topo), "seconds": 0.5 * t,
        "every_k_iterations": 2}, measure_stall),
    Case("throttle, every 3rd iteration", "x", lambda rng, topo, t: {
        "kind": "throttle", "rank": _rank(rng, topo), "factor": 2.0, "every_k_iterations": 3},
        measure_throttle),
    Case("link_flap", "s", lambda rng, topo, t: {
        "kind": "link_flap", "ranks": _pipeline_pair(rng, topo), "down_ms": 200 * t,
        "every_s": 2 * t, "start_s": float(rng.uniform(0, 2 * t)), "retry_ms": 100 * t},
        measure_flap, twin=True),
    Case("crash", "s", lambda rng, topo, t: {
        "kind": "crash", "rank": _rank(rng, topo), "at_s": float(rng.uniform(2.5 * t, 4.5 * t))},
        measure_crash),
    Case("device_variation", "x", lambda rng, topo, t: {
        "kind": "device_variation", "sigma": 0.1}, measure_variation),
    Case("none (healthy control)", "", lambda rng, topo, t: {}, measure_nothing),
)


# ---------------------------------------------------------------- runs
def run_function(backend: str) -> Callable[[Any], Any]:
    from backends.registry import run_function as named
    from megatronapp.program.backend import RunOptions

    if backend == "torch":
        return named("torch", RunOptions(stall_timeout_s=TORCH_STALL_TIMEOUT_S))
    return named("sim")


def one_seed(case: Case, backend: str, seed: int, t: float, run: Callable[[Any], Any],
             keep: Path) -> dict[str, Any]:
    """One seed's fault, run and measured; its run's directory written under
    ``keep`` and scored from there, as ``--rescore`` scores it again."""
    from megatronapp.parallel.topology import Topology
    from megatronapp.scenario.config import parse_scenario

    job = JOBS[backend]
    p = job["parallel"]
    rng = np.random.default_rng([seed, CASES.index(case)])
    fault = case.fault(rng, Topology(p["tp"], p["pp"], p["dp"]), t)
    base = {**job, "name": f"{backend}-{seed}", "seed": seed}
    s = parse_scenario({**base, "faults": [fault] if fault else []})
    faulty = run(s)
    twin = run(parse_scenario(base)) if case.twin else None
    injected, realized = case.measure(s, faulty, twin)
    out = kept_dir(keep, backend, case, seed)
    kept_run(out, s, faulty, {"backend": backend, "kind": case.label, "seed": seed,
                              "injected": injected,
                              "realized": realized if math.isfinite(realized) else None})
    return scored_run(out)[1]


def scored(s: Any, scan: Any, stopped: dict[str, Any] | None) -> dict[str, Any]:
    """MegaScan's verdict on ``scan`` against ``s``'s faults, and whether the
    run's own stop record names the rank a fail-stop fault stopped."""
    from megatronapp.faults import ground_truth
    from megatronapp.scan.eval.verdicts import verdict
    from megatronapp.scan.methods import detector
    from megatronapp.scenario.config import fault_job

    truth = ground_truth(s.faults, fault_job(s))
    stops = [tr.rank for tr in truth if tr.effect == "stop"]
    return {"fault": s.faults[0].model_dump(mode="json") if s.faults else {},
            "verdict": verdict(detector("megascan")(scan), truth).to_json(),
            "truth": [tr.to_json() for tr in truth],
            "units_struck": next((u for tr in truth if (u := units_struck(scan, tr)) is not None),
                                 None),
            "stop_recorded": None if not stops else
            stopped is not None and stopped.get("rank") in stops}


SUSPECTS = ("compute", "host", "link")  # the truths' effects that are MegaScan's suspect kinds


def units_struck(scan: Any, truth: Any) -> float | None:
    """How far the faulty suspect stood out where the fault struck: the median,
    over the iterations it hit (all, for a fault without a schedule), of
    MegaScan's noise units for it (its excess over its expected time in units
    of the run's noise); None where it was not a suspect (a stop, a spread)
    or not among those MegaScan replayed."""
    from megatronapp.scan.evidence.detect import Detector

    kind = truth.effect
    if kind not in SUSPECTS or truth.rank is None:
        return None
    who: Any = truth.rank if truth.peer is None else tuple(sorted((truth.rank, truth.peer)))
    detector = Detector(scan.gpus_per_node, scan.scenario)
    detector.feed(scan)
    for e in detector.evidence():
        if e.kind == kind and (tuple(e.who) if kind == "link" else e.who) == who:
            struck = np.isin(e.iterations, truth.iterations or e.iterations)
            return float(np.median(e.units[struck])) if struck.any() else None
    return None


# ------------------------------------------------------- kept runs
KEPT_FILE = "faults_table_seed.json"  # in a kept run's directory: backend, kind, seed, measures
KEEP = Path("runs") / NAME  # relative to where the table is made, as ``megatronapp run --out``


def kept_dir(keep: Path, backend: str, case: Case, seed: int) -> Path:
    return keep / backend / _kind_name(case) / f"seed{seed:04d}"


def kept_run(out: Path, s: Any, result: Any, record: dict[str, Any]) -> None:
    """The run's directory as ``megatronapp run`` writes it (trace, summary,
    ground truth), and what the table measured of it."""
    from megatronapp.io.outdirs import staged_dir
    from megatronapp.run.write import write_run

    with staged_dir(out, force=True, option="--keep") as tmp:
        write_run(s, result, tmp)
        (tmp / KEPT_FILE).write_text(json.dumps(record, indent=1))


def scored_run(run_dir: Path) -> tuple[str, dict[str, Any]]:
    """A kept run scored by the installed detector from its directory, as
    ``megatronapp scan`` reads one (each rank's trace on its own clock, the
    job without its faults); the faults are read for the score only. Its key
    (backend/kind) and its seed's row."""
    from megatronapp.errors import UserError
    from megatronapp.io.gate import read_json
    from megatronapp.scan.align.inputs import load_scan_input
    from megatronapp.scenario.config import parse_scenario

    try:
        record = read_json(run_dir / KEPT_FILE, "--rescore")
        summary = read_json(run_dir / "summary.json", "--rescore")
        key = f"{record['backend']}/{record['kind']}"
        row = {k: record[k] for k in ("seed", "injected", "realized")}
        s = parse_scenario(summary["scenario"])
    except ValueError as err:  # a TextError or a scenario that no longer validates
        raise UserError(f"--rescore: {run_dir}: {err}") from None
    except (KeyError, TypeError) as err:
        raise UserError(f"--rescore: {run_dir}: not a kept run of this table ({err})") from None
    if record["backend"] not in JOBS or record["kind"] not in {c.label for c in CASES}:
        raise UserError(f"--rescore: {run_dir}: no {record['backend']!r} row of kind "
                        f"{record['kind']!r} in this table")
    return key, {**row, **scored(s, load_scan_input(run_dir), summary.get("stopped"))}


def rescore(data: dict[str, Any], keep: Path, command: list[str]) -> list[str]:
    """Every kept run under ``keep`` scored again; each kind and backend's row
    rebuilt from exactly the seeds kept (the keys rescored, in order)."""
    from megatronapp.errors import UserError

    found: dict[str, list[dict[str, Any]]] = {}
    started, load = time.perf_counter(), results.load()
    for run_dir in sorted(p.parent for p in Path(keep).glob(f"*/*/seed*/{KEPT_FILE}")):
        key, row = scored_run(run_dir)
        found.setdefault(key, []).append(row)
    if not found:
        raise UserError(f"--rescore: no kept runs in {keep} (write some with --keep)")
    labels = {c.label: c for c in CASES}
    for key, rows in found.items():
        backend, label = key.split("/", 1)
        rows.sort(key=lambda r: r["seed"])
        data["seeds"][key] = rows
        _record_part(data, f"{key} rescored seeds {rows[0]['seed']}-{rows[-1]['seed']}",
                     command, started, load)
        _set_row(data, summary(labels[label], backend, rows))
    return list(found)


def healthy_iteration_s(backend: str, run: Callable[[Any], Any]) -> float:
    from megatronapp.scenario.config import parse_scenario
    from megatronapp.trace.summary import run_iteration_times

    times = run_iteration_times(run(parse_scenario({**JOBS[backend], "seed": 0})))
    return statistics.median(times[1:])


def summary(case: Case, backend: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    iterations = [r["verdict"]["iterations"] for r in rows]
    stops = [r.get("stop_recorded") for r in rows]
    return {"kind": case.label, "backend": backend, "seeds": len(rows), "unit": case.unit,
            "injected_mean": statistics.fmean(r["injected"] for r in rows),
            "realized_mean": _finite_mean([r["realized"] for r in rows]),
            "named_first": sum(r["verdict"]["named_first"] for r in rows),
            "named": sum(r["verdict"]["named"] for r in rows),
            "iterations_named": None if all(i is None for i in iterations)
            else sum(bool(i) for i in iterations),
            "stops_recorded": None if all(s is None for s in stops) else sum(map(bool, stops)),
            "units_struck": _range([r.get("units_struck") for r in rows]),
            "first_causes": sorted({str(r["verdict"]["first"]) for r in rows})}


def _range(values: list[float | None]) -> list[float] | None:
    """The least and the most of the seeds' values that were measured."""
    known = [v for v in values if v is not None]
    return [min(known), max(known)] if known else None


def _finite_mean(values: list[float | None]) -> float:
    """The mean of what could be measured (a rank that recorded nothing has no last op)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(finite) if finite else math.nan


def _previous() -> dict[str, Any]:
    try:
        data: dict[str, Any] = results.read(NAME)["data"]
    except FileNotFoundError:
        return empty()
    return data


def empty() -> dict[str, Any]:
    return {"rows": [], "seeds": {}, "iteration_s": {}, "parts": {}}


def _kind_name(case: Case) -> str:
    return case.label.split(",")[0].split(" ")[0]


def _record_part(data: dict[str, Any], name: str, command: list[str], started: float,
                 load: list[float]) -> None:
    data["parts"][name] = {"command": command, "load_before": load, "load_after": results.load(),
                           "wall_s": time.perf_counter() - started,
                           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _set_row(data: dict[str, Any], row: dict[str, Any]) -> None:
    """``row`` in place of its kind and backend's, the rows in the table's order."""
    order = {(b, c.label): i for i, (b, c) in enumerate(
        (b, c) for b in JOBS for c in CASES)}
    data["rows"] = sorted([r for r in data["rows"] if (r["backend"], r["kind"])
                           != (row["backend"], row["kind"])] + [row],
                          key=lambda r: order[(r["backend"], r["kind"])])


def run_part(data: dict[str, Any], backend: str, kinds: list[str], seeds: range,
             command: list[str], keep: Path) -> None:
    """Run ``seeds`` of each of ``kinds`` on ``backend`` into ``data``: each
    kind's seeds replace the same seeds of earlier parts, the row is rebuilt
    from all its seeds, and the part's date, load and command are kept."""
    fn = run_function(backend)
    if backend not in data["iteration_s"]:  # every part sizes its faults by the same T
        data["iteration_s"][backend] = healthy_iteration_s(backend, fn)
    t = data["iteration_s"][backend]
    for case in (c for c in CASES if _kind_name(c) in kinds):
        started, load = time.perf_counter(), results.load()
        key = f"{backend}/{case.label}"
        kept = {r["seed"]: r for r in data["seeds"].get(key, [])}
        for seed in seeds:
            print(f"{backend} {case.label} seed {seed} (T = {t:.4g} s)", flush=True)
            kept[seed] = one_seed(case, backend, seed, t, fn, keep)
        rows = data["seeds"][key] = [kept[k] for k in sorted(kept)]
        _record_part(data, f"{key} seeds {seeds.start}-{seeds.stop - 1}", command, started, load)
        _set_row(data, summary(case, backend, rows))


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m experiments.faults_table",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--backends", default=",".join(JOBS))
    parser.add_argument("--kinds", default=",".join(_kind_name(c) for c in CASES))
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, default=KEEP,
                        help=f"where each run's directory is written (default {KEEP})")
    parser.add_argument("--rescore", type=Path, metavar="DIR",
                        help="score the runs kept in DIR again; run nothing")
    return parser.parse_args(argv)


def _checked(args: argparse.Namespace) -> argparse.Namespace:
    """One line naming the first option that cannot be honoured."""
    from megatronapp.errors import UserError

    names = {_kind_name(c) for c in CASES}
    if args.seeds < 1:
        raise UserError(f"--seeds: must be >= 1, got {args.seeds}")
    for option, given, known in (("--backends", args.backends, set(JOBS)),
                                 ("--kinds", args.kinds, names)):
        unknown = sorted(set(given.split(",")) - known)
        if unknown:
            raise UserError(f"{option}: unknown {', '.join(unknown)} "
                            f"(one of {', '.join(sorted(known))})")
    return args


def main(argv: list[str] | None = None) -> None:
    from megatronapp.errors import UserError

    try:
        args = _checked(_arguments(argv))
        run = results.start(NAME, argv)
        data = _previous()
        if args.rescore is not None:
            rescore(data, args.rescore, run.argv)
        for backend in ([] if args.rescore is not None else args.backends.split(",")):
            run_part(data, backend, args.kinds.split(","),
                     range(args.first_seed, args.first_seed + args.seeds), run.argv, args.keep)
    except UserError as err:
        print(err, file=sys.stderr)
        raise SystemExit(2) from None
    print(run.record(data))


def _amount(value: float, unit: str) -> str:
    return f"{value:.4g} {unit}" if unit else "-"


def _iterations(row: dict[str, Any]) -> str:
    return "n/a (not listed)" if row["iterations_named"] is None else \
        f"{row['iterations_named']} of {row['seeds']}"


def _named_first(row: dict[str, Any]) -> str:
    """MegaScan's count; for a fail-stop kind, the runs' own stop records beside it."""
    named = f"{row['named_first']} of {row['seeds']}"
    stops = row.get("stops_recorded")
    return named if stops is None else f"{named} (stop recorded: {stops} of {row['seeds']})"


def _units(row: dict[str, Any]) -> str:
    units = row.get("units_struck")
    return "-" if units is None else " to ".join(
        f"{u:,.0f}" if abs(u) >= 100 else f"{u:.3g}" for u in units)


def tables(doc: dict[str, Any]) -> dict[str, str]:
    rows = [[r["kind"], r["backend"], r["seeds"], _amount(r["injected_mean"], r["unit"]),
             _amount(r["realized_mean"], r["unit"]), _units(r), _named_first(r),
             f"{r['named']} of {r['seeds']}",
             _iterations(r), ", ".join("healthy" if c == "None" else c
                                       for c in r["first_causes"])] for r in doc["data"]["rows"]]
    return {"kinds": markdown_table(
        ["kind", "backend", "seeds", "injected (mean)", "realised (mean)",
         "its noise units where it struck (median; seeds' range)",
         "MegaScan named first (control: called healthy)", "named at all", "iterations named",
         "first causes named"], rows, "llrrrrrrrl")}


if __name__ == "__main__":
    main()
