"""The fault kinds real jobs suffer, each in simulation and on the torch
backend: what was injected, what the run realised, and what MegaScan named
(through its public entry points: ``megatronapp.scan.methods.detector`` on
``scan_of_result``, so the table follows whichever detector is installed).

    python -m experiments.faults_table [--seeds 10] [--backends sim,torch] [--kinds K,K]

Per kind and backend, ``--seeds`` runs of one job, the fault placed and timed
by the seed in units of the job's healthy iteration time ``T`` (one healthy
run per backend). Realised effects are measured inside the faulty run where
they can be (a stalled iteration against the rank's others), against a
healthy twin of the same seed where they cannot (a flapping link). Real runs
take a minute each on a loaded 2-core machine, so ``--kinds`` runs some kinds
(by kind name) and keeps the others' rows of the results file, each part
with its own date, load and command.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
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
def _events(run: Any, rank: int) -> list[Any]:
    return sorted(run.events[rank], key=lambda e: e.start_s)


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
    return max(e.start_s + e.dur_s for events in run.events.values() for e in events)


def _start_s(run: Any) -> float:
    return min(e.start_s for events in run.events.values() for e in events)


def measure_flap(s: Any, run: Any, twin: Any) -> tuple[float, float]:
    """The outage time of the drops inside the job, against the time it lost."""
    outage = s.faults[0].outage
    drops = [t for t in outage.downs(_end_s(twin)) if t + outage.down_s > _start_s(twin)]
    injected = len(drops) * (outage.down_s + outage.retry_s)
    return injected, (_end_s(run) - _start_s(run)) - (_end_s(twin) - _start_s(twin))


def measure_crash(s: Any, run: Any, _twin: Any) -> tuple[float, float]:
    """When the rank was to die, against the end of its last recorded op."""
    fault = s.faults[0]
    return fault.at_s, max(e.start_s + e.dur_s for e in run.events[fault.rank])


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


def one_seed(case: Case, backend: str, seed: int, t: float, run: Callable[[Any], Any]
             ) -> dict[str, Any]:
    from megatronapp.faults import ground_truth
    from megatronapp.parallel.topology import Topology
    from megatronapp.scan.eval.validate import scan_of_result
    from megatronapp.scan.eval.verdicts import verdict
    from megatronapp.scan.methods import detector
    from megatronapp.scenario.config import fault_job, parse_scenario

    job = JOBS[backend]
    p = job["parallel"]
    rng = np.random.default_rng([seed, CASES.index(case)])
    fault = case.fault(rng, Topology(p["tp"], p["pp"], p["dp"]), t)
    base = {**job, "name": f"{backend}-{seed}", "seed": seed}
    s = parse_scenario({**base, "faults": [fault] if fault else []})
    faulty = run(s)
    twin = run(parse_scenario(base)) if case.twin else None
    injected, realized = case.measure(s, faulty, twin)
    found = verdict(detector("megascan")(scan_of_result(faulty, scenario=s)),
                    ground_truth(s.faults, fault_job(s)))
    return {"seed": seed, "fault": fault and s.faults[0].model_dump(mode="json"),
            "injected": injected,
            "realized": realized, "verdict": found.to_json(),
            "truth": [tr.to_json() for tr in ground_truth(s.faults, fault_job(s))]}


def healthy_iteration_s(backend: str, run: Callable[[Any], Any]) -> float:
    from megatronapp.scenario.config import parse_scenario
    from megatronapp.trace.summary import run_iteration_times

    times = run_iteration_times(run(parse_scenario({**JOBS[backend], "seed": 0})))
    return statistics.median(times[1:])


def summary(case: Case, backend: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    iterations = [r["verdict"]["iterations"] for r in rows]
    return {"kind": case.label, "backend": backend, "seeds": len(rows), "unit": case.unit,
            "injected_mean": statistics.fmean(r["injected"] for r in rows),
            "realized_mean": statistics.fmean(r["realized"] for r in rows),
            "named_first": sum(r["verdict"]["named_first"] for r in rows),
            "named": sum(r["verdict"]["named"] for r in rows),
            "iterations_named": None if all(i is None for i in iterations)
            else sum(bool(i) for i in iterations),
            "first_causes": sorted({str(r["verdict"]["first"]) for r in rows})}


def _previous() -> dict[str, Any]:
    try:
        data: dict[str, Any] = results.read(NAME)["data"]
    except FileNotFoundError:
        return {"rows": [], "seeds": {}, "iteration_s": {}, "parts": {}}
    return data


def _kind_name(case: Case) -> str:
    return case.label.split(",")[0].split(" ")[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--backends", default="sim,torch")
    parser.add_argument("--kinds", default=",".join(_kind_name(c) for c in CASES))
    parser.add_argument("--first-seed", type=int, default=0)
    args = parser.parse_args(argv)
    run = results.start(NAME, argv)
    data = _previous()
    kinds = args.kinds.split(",")
    for backend in args.backends.split(","):
        fn = run_function(backend)
        if backend not in data["iteration_s"]:  # every part sizes its faults by the same T
            data["iteration_s"][backend] = healthy_iteration_s(backend, fn)
        t = data["iteration_s"][backend]
        for case in (c for c in CASES if _kind_name(c) in kinds):
            started, load = time.perf_counter(), results.load()
            key = f"{backend}/{case.label}"
            kept = {r["seed"]: r for r in data["seeds"].get(key, [])}
            seeds = range(args.first_seed, args.first_seed + args.seeds)
            for seed in seeds:
                print(f"{backend} {case.label} seed {seed} (T = {t:.4g} s)", flush=True)
                kept[seed] = one_seed(case, backend, seed, t, fn)
            rows = data["seeds"][key] = [kept[k] for k in sorted(kept)]
            data["parts"][f"{key} seeds {seeds.start}-{seeds.stop - 1}"] = {
                "command": run.argv, "load_before": load, "load_after": results.load(),
                "wall_s": time.perf_counter() - started,
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            data["rows"] = [r for r in data["rows"] if (r["backend"], r["kind"])
                            != (backend, case.label)] + [summary(case, backend, rows)]
    order = {(b, c.label): i for i, (b, c) in enumerate(
        (b, c) for b in ("sim", "torch") for c in CASES)}
    data["rows"].sort(key=lambda r: order[(r["backend"], r["kind"])])
    print(run.record(data))


def _amount(value: float, unit: str) -> str:
    return f"{value:.4g} {unit}" if unit else "-"


def _iterations(row: dict[str, Any]) -> str:
    return "n/a (not listed)" if row["iterations_named"] is None else \
        f"{row['iterations_named']} of {row['seeds']}"


def tables(doc: dict[str, Any]) -> dict[str, str]:
    rows = [[r["kind"], r["backend"], r["seeds"], _amount(r["injected_mean"], r["unit"]),
             _amount(r["realized_mean"], r["unit"]),
             f"{r['named_first']} of {r['seeds']}", f"{r['named']} of {r['seeds']}",
             _iterations(r), ", ".join("healthy" if c == "None" else c
                                       for c in r["first_causes"])] for r in doc["data"]["rows"]]
    return {"kinds": markdown_table(
        ["kind", "backend", "seeds", "injected (mean)", "realised (mean)",
         "MegaScan named first (control: called healthy)", "named at all", "iterations named",
         "first causes named"], rows, "llrrrrrrl")}


if __name__ == "__main__":
    main()
