"""Detector validation: random jobs with a known injected fault (or none)
(``trials.py``), run by a backend's run function (the simulator, or real
processes), handed to every detector through the same unaligned per-rank
traces a real job produces, and scored against the ground truth. Real runs
can be kept and scored again later (``replay_trial``)."""
from __future__ import annotations

import csv
import json
import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np

from megatronapp.costs.run_size import RunSize
from megatronapp.errors import UserError
from megatronapp.host import limits
from megatronapp.io import gate
from megatronapp.io.text import TextError
from megatronapp.host.executors import Where, map_unordered
from megatronapp.io.outdirs import new_file, remove_result, staged_dir
from megatronapp.trace.on_disk import write_traces
from megatronapp.scenario.config import Scenario
from megatronapp.trace.events import RunResult, RunScenario, chrome_events

from megatronapp.scan.align.align import trace_span
from megatronapp.scan.eval.clock_truth import score_against_truth
from megatronapp.scan.diagnosis import Detector, Diagnosis
from megatronapp.scan.align.inputs import ScanInput, prepare, prepare_loaded
from megatronapp.scan.ingest.load import events_from_chrome, load_trace
from megatronapp.scan.methods import DETECTORS, detector
from megatronapp.scan.eval.trials import CONTROLS, PLANS, REAL, SIM, Trial, TrialPlan, matches

METHODS: dict[str, Detector] = {name: detector(name) for name in DETECTORS}
TRIAL_FILE = "trial.json"  # in a saved trial's run directory: plan, seed, index, band


@dataclass(frozen=True)
class Outcome:
    trial: int
    band: str
    method: str
    reported: int
    correct_reported: int
    top1: bool
    found: bool
    # with the devices and links slow at no cost listed after the causes
    flagged_top1: bool = False  # the first of them all is the fault
    flagged: bool = False  # anything listed at all


def scan_of_result(result: RunResult, name: str = "<sim>", scenario: Scenario | None = None
                   ) -> ScanInput:
    """What a detector sees of a run: per-rank Chrome events in each rank's
    local clock (as the run directory stores them), aligned again, with the
    ``scenario`` it ran (as a run directory's summary records it)."""
    raw = [ev for r in sorted(result.events) for ev in chrome_events(
        r, result.label(r), result.events[r], result.clocks[r].local)]
    return replace(prepare(events_from_chrome(raw, name), aligned=False, ref=0), scenario=scenario)


def score_trial(trial: Trial, scan: ScanInput, clocks: Mapping[str, Any]
                ) -> tuple[list[Outcome], dict[str, float]]:
    """Every method's outcome on one trial, and the clock alignment's error
    against the injected ``clocks`` (rank -> {offset_us, drift_ppm})."""
    alignment = score_against_truth(scan.clocks, clocks, ref=0, span=trace_span(scan.events))
    scan = replace(scan, scenario=trial.scenario)  # what a run directory's summary records
    return [_outcome(trial, name, method(scan)) for name, method in METHODS.items()], alignment


def run_trial(seed: int, index: int, run: RunScenario, plan: TrialPlan = SIM,
              keep: Path | None = None) -> "TrialReport":
    """Run one trial with ``run`` (a backend's run function) and score every
    method on it, plus the clock alignment. With ``keep``, the run directory
    is saved as ``keep/trial{index:04d}`` for ``replay_trial``. The machine's
    load (1-minute average, before and after) is kept with the scores: on a
    shared machine it decides how noisy a real run is."""
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    trial = plan.make(seed, index)
    result = run(trial.scenario)
    load = (load_before + os.getloadavg()[0]) / 2
    if keep is not None:
        save_trial(trial, result, plan, seed, keep, load)
    outcomes, alignment = score_trial(trial, scan_of_result(result, trial.scenario.name),
                                      injected_clocks(result))
    return TrialReport(index, tuple(outcomes), alignment, time.perf_counter() - start,
                       load=load, shape=shape_of(trial), plan=plan.name)


def shape_of(trial: Trial) -> str:
    p = trial.scenario.parallel
    return f"tp{p.tp} pp{p.pp} dp{p.dp}"


def injected_clocks(result: RunResult) -> dict[str, dict[str, float]]:
    return {str(r): {"offset_us": c.offset_us, "drift_ppm": c.drift_ppm}
            for r, c in result.clocks.items()}


def save_trial(trial: Trial, result: RunResult, plan: TrialPlan, seed: int, keep: Path,
               load: float | None = None) -> Path:
    """The trial's trace (``trace.parquet``, each rank's clock in its metadata;
    ``trace.json`` too when small), the injected truth and how to make the
    trial again."""
    final = keep / f"trial{trial.index:04d}"
    with staged_dir(final, force=True, option="--save-runs") as tmp:
        write_traces(trial.scenario, result, tmp)
        faults = [f.model_dump(mode="json") for f in trial.scenario.faults]
        (tmp / "ground_truth.json").write_text(json.dumps({"clocks": injected_clocks(result),
                                                           "faults": faults}))
        (tmp / TRIAL_FILE).write_text(json.dumps({"plan": plan.name, "seed": seed,
                                                  "index": trial.index, "band": trial.band,
                                                  "machine_load": load}))
    return final


def saved_trials(corpus: Path) -> list[Path]:
    return sorted(p.parent for p in Path(corpus).glob(f"trial*/{TRIAL_FILE}"))


def clear_saved_trials(corpus: Path) -> None:
    """A kept directory holds one validation's trials: drop an earlier one's."""
    for run_dir in saved_trials(corpus):
        remove_result(run_dir, "--save-runs")


def _saved_json(path: Path) -> Any:
    """A saved trial's JSON file, through the input gate; one line naming it otherwise."""
    try:
        return gate.read_json(path, "--replay")
    except TextError as err:
        raise UserError(str(err)) from None


def replay_trial(run_dir: Path) -> "TrialReport":
    """Score a saved trial again from its trace on each rank's clock (no run)."""
    start = time.perf_counter()
    meta = _saved_json(run_dir / TRIAL_FILE)
    trial = PLANS[meta["plan"]].make(int(meta["seed"]), int(meta["index"]))
    scan = prepare_loaded(load_trace(run_dir))
    clocks = _saved_json(run_dir / "ground_truth.json")["clocks"]
    outcomes, alignment = score_trial(trial, scan, clocks)
    return TrialReport(trial.index, tuple(outcomes), alignment, time.perf_counter() - start,
                       load=meta.get("machine_load"), shape=shape_of(trial), plan=meta["plan"])


def _outcome(trial: Trial, method: str, d: Diagnosis) -> Outcome:
    hits = [matches(c, trial) for c in d.root_causes]
    listed = d.root_causes + d.slow_without_cost
    return Outcome(trial.index, trial.band, method, len(hits), sum(hits),
                   bool(hits) and hits[0], any(hits),
                   bool(listed) and matches(listed[0], trial), bool(listed))


# ------------------------------------------------------------- tables
@dataclass(frozen=True)
class Row:
    method: str
    band: str
    trials: int
    top1: float | None
    precision: float | None
    recall: float | None
    fpr: float | None
    flagged_top1: float | None = None  # top1 with the slow at no cost after the causes
    flagged_fpr: float | None = None  # controls with anything listed at all


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def summarize(outcomes: Iterable[Outcome], bands: Iterable[str] = SIM.bands) -> list[Row]:
    """Per method: one row per band, one for all faults, one for all controls."""
    groups: dict[tuple[str, str], list[Outcome]] = defaultdict(list)
    for o in outcomes:
        groups[(o.method, o.band)].append(o)
        groups[(o.method, "all controls" if o.band in CONTROLS else "all faults")].append(o)
    order = list(bands) + ["all faults", "all controls"]
    rows = []
    for method in METHODS:
        for band in order:
            rows.append(_row(method, band, groups.get((method, band), [])))
    return [r for r in rows if r.trials]


def _row(method: str, band: str, os_: list[Outcome]) -> Row:
    control = band in CONTROLS or band == "all controls"
    reported = sum(o.reported for o in os_)
    precision = None if control else _ratio(sum(o.correct_reported for o in os_), reported)
    if control:
        return Row(method, band, len(os_), None, None, None,
                   _ratio(sum(o.reported > 0 for o in os_), len(os_)),
                   flagged_fpr=_ratio(sum(o.flagged for o in os_), len(os_)))
    return Row(method, band, len(os_), _ratio(sum(o.top1 for o in os_), len(os_)), precision,
               _ratio(sum(o.found for o in os_), len(os_)), None,
               flagged_top1=_ratio(sum(o.flagged_top1 for o in os_), len(os_)))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def write_csv(rows: list[Row], path: Path, force: bool = False, option: str = "--csv") -> None:
    """The accuracy table, written whole (a temporary renamed into place) or not at all."""
    with new_file(path, option, force, make_parent=True) as tmp, open(tmp, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["method", "band", "trials", "top1", "precision", "recall", "fpr",
                    "flagged_top1", "flagged_fpr"])
        for r in rows:
            w.writerow([r.method, r.band, r.trials] + ["" if v is None else f"{v:.4f}" for v in
                                                         (r.top1, r.precision, r.recall, r.fpr,
                                                          r.flagged_top1, r.flagged_fpr)])


def markdown_table(rows: list[Row]) -> str:
    lines = ["| method | band | trials | top-1 | precision | recall | false-positive rate "
             "| with slow at no cost: top-1 | ...: anything listed |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.method} | {r.band} | {r.trials} | {_pct(r.top1)} | {_pct(r.precision)} | "
              f"{_pct(r.recall)} | {_pct(r.fpr)} | {_pct(r.flagged_top1)} | "
              f"{_pct(r.flagged_fpr)} |" for r in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class TrialReport:
    """One trial's scores, or why it could not run (a real run can fail)."""

    index: int
    outcomes: tuple[Outcome, ...]
    alignment: dict[str, float] | None
    seconds: float
    error: str | None = None
    load: float | None = None  # the machine's 1-minute load average while it ran
    shape: str = ""
    plan: str = ""


SAMPLED_TRIALS = 16  # trials priced one by one before any runs; the rest at their mean


def estimate_trials(plan: TrialPlan, seed: int, trials: int, where: Where,
                    count: Callable[[Scenario], RunSize | None] | None = None,
                    real: bool = False) -> limits.Estimate:
    """``trials`` trials priced before any runs: the first ``SAMPLED_TRIALS``
    simulated and detected one by one, the rest at their mean (``real`` trials
    at least a real job's measured time each); each trial's report is kept to
    the end. Local processes share the time."""
    sample = [plan.make(seed, i).scenario for i in range(min(trials, SAMPLED_TRIALS))]
    runs = [limits.estimate_run(s, count) for s in sample]
    detect = limits.COSTS.detect_events
    seconds = sum(r.seconds + r.events * detect.seconds_per_event for r in runs) / len(runs)
    if real:
        seconds = max(seconds, limits.COSTS.real_trial_seconds)
    most = max(r.memory_bytes + r.events * detect.bytes_per_event for r in runs)
    workers = 1 if where.ray_address else max(1, min(where.jobs, trials))
    return limits.Estimate(ranks=max(r.ranks for r in runs), events=0, group_entries=0,
                           faults=0, memory_bytes=most * workers
                           + trials * limits.COSTS.trial_report_bytes,
                           disk_bytes=0.0, seconds=seconds * trials / workers)


def run_trials(seed: int, trials: int, where: Where, run: RunScenario, plan: TrialPlan = SIM,
               keep: Path | None = None, on_start: Callable[[Trial], None] = lambda t: None,
               ) -> Iterator[TrialReport]:
    """Every trial's report, in completion order, wherever ``where`` says
    (``run`` must be a module-level function: it is pickled). ``on_start``
    hears of each trial when they run one at a time here. A trial whose run
    fails with a ``UserError`` (a real job that hung or lost a rank) is
    reported as failed and the others go on."""
    args = [(seed, i, run, plan, keep) for i in range(trials)]
    if keep is not None:
        clear_saved_trials(keep)
    if where.jobs <= 1 and not where.ray_address:
        for a in args:
            on_start(plan.make(seed, a[1]))
            yield _run_trial_star(a)
        return
    yield from map_unordered(_run_trial_star, args, where)


def _run_trial_star(args: tuple[int, int, RunScenario, TrialPlan, Path | None]) -> TrialReport:
    start = time.perf_counter()
    try:
        return run_trial(*args)
    except UserError as err:
        return TrialReport(args[1], (), None, time.perf_counter() - start, str(err))


def replay_trials(corpus: Path) -> Iterator[TrialReport]:
    for run_dir in saved_trials(corpus):
        yield replay_trial(run_dir)


QUIET_LOAD = 6.0  # 1-min load average: a 4-rank job plus light background work


def alignment_line(reports: list[TrialReport], label: str = "") -> str:
    a = alignment_summary([r.alignment for r in reports if r.alignment is not None])
    return (f"clock alignment over {a['trials']} trials{label}: offset error median "
            f"{a['offset_err_median_us']:.4f} us, worst {a['offset_err_worst_us']:.4f} us; "
            f"drift error worst {a['drift_err_worst_ppm']:.4f} ppm")


def real_run_lines(reports: list[TrialReport], bands: Iterable[str]) -> list[str]:
    """For real runs: alignment by job shape, and MegaScan's accuracy on a
    quiet machine against a loaded one (the machine brings the noise)."""
    ok = [r for r in reports if r.error is None and r.plan == REAL.name]
    lines = []
    for shape in sorted({r.shape for r in ok}):
        lines.append(alignment_line([r for r in ok if r.shape == shape], f" ({shape})"))
    loads = [r.load for r in ok if r.load is not None]
    if not loads:
        return lines
    lines.append(f"machine load (1-min average) during the trials: median {np.median(loads):.1f}, "
                 f"range {min(loads):.1f}-{max(loads):.1f}")
    for label, keep in ((f"load <= {QUIET_LOAD:g}", lambda x: x <= QUIET_LOAD),
                        (f"load > {QUIET_LOAD:g}", lambda x: x > QUIET_LOAD)):
        part = [o for r in ok if r.load is not None and keep(r.load) for o in r.outcomes
                if o.method == "megascan"]
        rows = {row.band: row for row in summarize(part, bands)}
        faults, controls = rows.get("all faults"), rows.get("all controls")
        lines.append(f"megascan at {label}: top-1 {_pct(faults.top1 if faults else None)} over "
                     f"{faults.trials if faults else 0} faults, false positives "
                     f"{_pct(controls.fpr if controls else None)} over "
                     f"{controls.trials if controls else 0} controls")
    return lines


def alignment_summary(scores: list[dict[str, float]]) -> dict[str, float]:
    worst = [s["offset_err_max_us"] for s in scores]
    drift = [s["drift_err_max_ppm"] for s in scores]
    med = [s["offset_err_median_us"] for s in scores]
    return {"trials": len(scores), "offset_err_median_us": float(np.median(med)) if med else math.nan,
            "offset_err_worst_us": max(worst, default=math.nan),
            "drift_err_worst_ppm": max(drift, default=math.nan)}
