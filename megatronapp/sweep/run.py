"""Running a sweep: one task per point, anywhere, one table of results."""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ..costs.run_size import RunSize
from ..host import limits
from ..faults import Truth, ground_truth
from ..scenario.config import Scenario, ScenarioError, fault_job, parse_scenario
from ..errors import UserError
from ..host.executors import Where, map_unordered
from ..io.outdirs import new_file
from ..trace.summary import summarize
from ..trace.events import RunScenario
from .spec import Point, SweepSpec


@dataclass(frozen=True)
class Task:
    point: Point
    run: RunScenario  # a backend's module-level run function
    detect: bool


def run_point(task: Task) -> dict[str, Any]:
    """One row: the point's values, its seed, the process that ran it (host:pid,
    to tell a cluster's nodes apart) and what the run measured."""
    p = task.point
    row: dict[str, Any] = {"point": p.index, "seed": p.seed, **p.values,
                           "worker": f"{socket.gethostname()}:{os.getpid()}"}
    start = time.perf_counter()
    try:
        scenario = parse_scenario(p.scenario)
        result = task.run(scenario)
    except (ScenarioError, UserError) as err:  # e.g. a point whose memory does not fit
        return {**row, "error": str(err)}
    row["run_wall_s"] = time.perf_counter() - start
    summary = summarize(result.events)
    times = summary["iteration_times_s"]
    row.update(iteration_time_s=sum(times) / len(times) if times else None,
               bubble_fraction=summary["bubble_fraction"],
               events=sum(len(v) for v in result.events.values()), error=None)
    if task.detect:
        row.update(_detection(result, scenario))
    return row


def _detection(result: Any, scenario: Scenario) -> dict[str, Any]:
    from ..scan.evidence.detect import megascan
    from ..scan.eval.validate import scan_of_result

    diagnosis = megascan(scan_of_result(result, scenario=scenario))
    causes = [(c.kind, c.rank, c.peer) for c in diagnosis.root_causes]
    truth = injected(scenario)
    return {"healthy": diagnosis.healthy,
            "root_causes": " ".join(cause_label(*c) for c in causes),
            "injected": " ".join(t.label for t in truth),
            "named_first": named_first(causes, truth, diagnosis.healthy)}


def injected(scenario: Scenario) -> list[Truth]:
    """What a detector should name (each fault kind's ground truth says: a
    throttled rank's compute, a stalled rank, a bad link; clock skew is the
    aligner's, a factor of 1 injects nothing)."""
    return [t for t in ground_truth(scenario.faults, fault_job(scenario))
            if t.should_name is not None]


def named_first(causes: Sequence[tuple[str, int, int | None]], truth: Sequence[Truth],
                healthy: bool) -> bool:
    """The first cause (kind, rank, peer) names an injected fault; with nothing
    injected, right when healthy."""
    return bool(causes) and any(t.matches(*causes[0]) for t in truth) if truth else healthy


def cause_label(kind: str, rank: int, peer: int | None) -> str:
    """``compute:5``, or ``link:2-7`` (the lower rank first, whichever side was named)."""
    if peer is None:
        return f"{kind}:{rank}"
    low, high = sorted((rank, peer))
    return f"{kind}:{low}-{high}"


def estimate_sweep(points: list[Point], where: Where, detect: bool,
                   count: Callable[[Scenario], RunSize | None] | None = None) -> limits.Estimate:
    """Every point simulated before any runs (``count``: the backend's count of
    each run): local processes run ``where.jobs`` points at once (each may hold
    the largest point's memory; the time is shared among them); a Ray cluster's
    machines are taken to be like this one. Detection builds an object per event
    on top."""
    scenarios = [parse_scenario(p.scenario) for p in points]
    runs = [limits.estimate_run(s, count) for s in scenarios]
    total = limits.in_sequence(runs)
    if detect:
        most = max(run.events for run in runs)
        total = replace(total, memory_bytes=total.memory_bytes
                        + most * limits.COSTS.detect_events.bytes_per_event)
    workers = 1 if where.ray_address else max(1, min(where.jobs, len(points)))
    return replace(total, memory_bytes=total.memory_bytes * workers,
                   seconds=total.seconds / workers)


def run_sweep(spec: SweepSpec, run: RunScenario, where: Where,
              on_done: Callable[[], None] = lambda: None) -> Iterator[dict[str, Any]]:
    """Every point's row, in completion order."""
    tasks = [Task(p, run, spec.model.detect) for p in spec.points()]
    yield from map_unordered(run_point, tasks, where, on_done)


def write_table(rows: list[dict[str, Any]], path: Path, force: bool = False,
                inputs: Sequence[Path] = (), then: Callable[[], None] | None = None) -> Path:
    """Rows sorted by point, as Parquet (``.parquet``) or CSV (``.csv``), atomically;
    ``then`` (another file written beside it) runs before the table is put in
    place, so that if it fails the table is not left behind either."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    if path.suffix not in (".parquet", ".csv"):
        raise UserError(f"--out: {path} must end in .parquet or .csv")
    columns = list(dict.fromkeys(k for r in rows for k in r))
    table = pa.Table.from_pylist([{c: r.get(c) for c in columns}
                                  for r in sorted(rows, key=lambda r: r["point"])])
    with new_file(path, "--out", force, inputs, make_parent=True) as tmp:
        if path.suffix == ".csv":
            pacsv.write_csv(table, tmp)
        else:
            pq.write_table(table, tmp)
        if then is not None:
            then()
    return path
