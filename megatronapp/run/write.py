"""Run directories: summary.json, ground truth, writing a run, exporting its trace.

Where a run may be written, and how it is published, is ``outdirs``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..trace.columns import source_of
from ..faults import ground_truth as fault_truth, skewed_ranks
from ..scenario.config import Scenario, adjustments, fault_job, scenario_to_dict
from ..errors import UserError
from ..program.features import feature_hooks
from ..trace.store import TRACE_FILE, StoreMeta
from ..trace.chrome import Ranges, write_chrome
from ..io.outdirs import new_file, staged_dir  # noqa: F401 (runs are written through staged_dir)
from ..trace.totals import BatchTotals, RunTotals
from ..trace.summary_file import SCHEMA_VERSION
from ..parallel.topology import Topology
from ..trace.events import RunResult, write_json
from ..trace.on_disk import Phase, write_traces


def ground_truth(s: Scenario, result: RunResult) -> dict[str, Any]:
    """What was injected, for scoring detectors and aligners (as each feature's
    runs need it)."""
    faults = [f.model_dump(mode="json") for f in s.faults]
    clocks = {str(r): {"offset_us": c.offset_us, "drift_ppm": c.drift_ppm}
              for r, c in sorted(result.clocks.items())}
    job = fault_job(s)
    truth = {"faults": faults, "clocks": clocks, "skewed_ranks": skewed_ranks(s.faults, job),
             "truth": [t.to_json() for t in fault_truth(s.faults, job)]}
    for feature in feature_hooks():
        truth = feature.ground_truth(result, truth)
    return truth


SUMMARY_BATCH = 1 << 18  # rows a summary batch holds about (whole pipelines, one at least)


def build_summary(s: Scenario, result: RunResult) -> dict[str, Any]:
    """The run's measures and the features' sections, accumulated in one pass
    over its batches of whole pipelines (a job with nothing reduced is never
    held as rows all at once)."""
    source = source_of(result)
    core = RunTotals()
    sections = [(feature, feature.summary_totals(s, result, source)) for feature in feature_hooks()]
    fed_too: list[BatchTotals] = [core, *(t for _f, t in sections if t is not None)]
    for batch in source.weighted_batches(SUMMARY_BATCH):
        for totals in fed_too:
            totals.add(*batch)
        del batch  # before the next batch is built: one held at a time
    measured = core.finish()
    if result.stopped is not None:  # the iteration a failure cut short is no iteration time
        measured["iteration_times_s"] = measured["iteration_times_s"][
            :result.stopped["iterations_completed"]]
    summary = {"schema_version": SCHEMA_VERSION, "backend": result.backend,
               "world_size": result.topo.world_size, "schedule": s.schedule, **measured,
               "faults": ground_truth(s, result)["faults"], **result.summary_items(),
               "adjustments": adjustments(s), "scenario": scenario_to_dict(s)}
    for feature, section in sections:
        summary.update(feature.summary_sections(s, result, source))
        if section is not None:
            summary.update(section.finish())
    return summary


def finite_json(data: Any) -> Any:
    """``data`` with every NaN or infinity replaced by null: JSON has no such
    numbers (an empty run's mean is undefined, not an invalid file)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite_json(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_json(v) for v in data]
    return data


def write_run(s: Scenario, result: RunResult, out_dir: Path,
              phase: Phase | None = None) -> dict[str, Any]:
    """Traces, ground truth and summary.json; an OSError (a full disk) is one line."""
    try:
        written = write_traces(s, result, out_dir, phase)
        summary = finite_json({**build_summary(s, result), "trace": written})
        write_json(out_dir / "ground_truth.json", finite_json(ground_truth(s, result)))
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False))
    except OSError as err:
        raise UserError(f"--out: cannot write the result: {err.strerror or err}") from None
    return summary


# ------------------------------------------------------------------ export
def run_label(meta: StoreMeta) -> Callable[[int], str]:
    """A rank's label in a stored run: its own, or its place in the topology."""
    topo_args = meta.extra.get("topology")
    labels = meta.extra.get("labels", {})
    topo = Topology(**topo_args) if topo_args else None

    def label(rank: int) -> str:
        if str(rank) in labels:
            return str(labels[str(rank)])
        return topo.label(rank) if topo is not None and rank < topo.world_size else f"rank {rank}"

    return label


def selection(store: Path, rank_ranges: Ranges | None, iteration_ranges: Ranges | None
              ) -> tuple[list[int] | None, list[int] | None, str | None]:
    """The ranks and iterations to export, within what the run holds: a rank
    past its world is refused, iterations past its last are left out (the
    note says so); memory is bounded by the run, whatever the ranges."""
    from ..trace.chrome import select
    from ..trace.store import StoreError, iteration_bound, read_meta

    try:
        world, last = read_meta(store).world_size, iteration_bound(store)
    except StoreError as err:
        raise UserError(f"RUN_DIR: {err}") from None
    ranks, _ = select(rank_ranges, "--ranks", world)
    iterations, note = select(iteration_ranges, "--iterations", last, clip=True)
    return ranks, iterations, note


def export_trace(run_dir: Path, ranks: list[int] | None, iterations: list[int] | None,
                 fmt: str, clock: str, out: Path | None, force: bool = False
                 ) -> tuple[Path, int]:
    """A selection of a run's trace.parquet as a Chrome (or Perfetto) trace file."""
    from ..trace.store import StoreError, iter_columns, local_clock_view, read_meta

    store = run_dir / TRACE_FILE
    if not store.is_file():
        raise UserError(f"RUN_DIR: {store} not found (runs written before trace.parquet keep "
                        "their trace.json)")
    try:
        meta = read_meta(store)
    except StoreError as err:
        raise UserError(f"RUN_DIR: {err}") from None
    if ranks is not None and max(ranks) >= meta.world_size:
        raise UserError(f"--ranks: rank {max(ranks)} out of range 0..{meta.world_size - 1}")
    suffix = ".json" if fmt == "chrome" else ".pftrace"
    out = out or run_dir / f"trace-{_selection_name(ranks, iterations)}{suffix}"
    batches = iter_columns(store, ranks, iterations)
    if clock == "local":
        batches = (local_clock_view(b, meta.clocks) for b in batches)
    with new_file(out, "--out", force, [store]) as tmp:  # a failed selection leaves nothing
        if fmt == "perfetto":
            from ..trace.perfetto import write_perfetto

            count = write_perfetto(tmp, batches, run_label(meta))
        else:
            count = write_chrome(tmp, batches, run_label(meta), {"clock": clock})
    return out, count


def _selection_name(ranks: list[int] | None, iterations: list[int] | None) -> str:
    def part(name: str, values: list[int] | None) -> str:
        if values is None:
            return f"all-{name}"
        if values == list(range(values[0], values[-1] + 1)):
            return f"{name}{values[0]}" + (f"-{values[-1]}" if len(values) > 1 else "")
        return f"{name}{values[0]}+{len(values) - 1}"
    return part("ranks", ranks) + "_" + part("it", iterations)
