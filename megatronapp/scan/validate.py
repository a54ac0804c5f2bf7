"""Detector validation: random jobs with a known injected fault (or none), run
on the simulator, handed to every detector through the same unaligned per-rank
traces a real job would produce, and scored against the ground truth."""
from __future__ import annotations

import csv
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from megatronapp import seeds
from megatronapp.config import Scenario, parse_scenario
from megatronapp.executors import Where, map_unordered
from megatronapp.files import atomic_file
from megatronapp.topology import Topology
from megatronapp.tracer import RunResult, RunScenario, chrome_events

from .align import score_against_truth
from .diagnosis import Detector, Diagnosis, RootCause
from .inputs import ScanInput, prepare
from .load import events_from_chrome
from .methods import DETECTORS, detector

METHODS: dict[str, Detector] = {name: detector(name) for name in DETECTORS}
# Severity bands drawn with equal probability; controls have no performance fault.
BANDS = ("throttle 1.05-1.1", "throttle 1.1-1.2", "throttle 1.2-2", "slow_link 1.5-4",
         "link_jitter 0.3-1", "clock_skew only", "healthy")
CONTROLS = ("clock_skew only", "healthy")
MAX_RANKS = 64


@dataclass(frozen=True)
class Trial:
    index: int
    band: str
    scenario: Scenario
    truth_rank: int | None  # the throttled rank
    truth_pair: tuple[int, int] | None  # the faulty link


def _shape(rng: np.random.Generator, needs_links: bool) -> tuple[int, int, int]:
    while True:
        tp, pp, dp = (int(rng.choice(c)) for c in ((1, 2, 4), (1, 2, 4), (1, 2, 4, 8)))
        world = tp * pp * dp
        if not 2 <= world <= MAX_RANKS:
            continue
        if needs_links and (pp < 2 or (pp - 1) * tp * dp < 6):
            continue  # a link is judged against other pipeline links of its kind
        return tp, pp, dp


def _fault(band: str, rng: np.random.Generator, topo: Topology) -> tuple[list[dict], int | None, tuple | None]:
    if band.startswith("throttle"):
        lo, hi = (float(x) for x in band.split()[1].split("-"))
        rank = int(rng.integers(topo.world_size))
        return [{"kind": "throttle", "rank": rank, "factor": float(rng.uniform(lo, hi))}], rank, None
    if band.startswith(("slow_link", "link_jitter")):
        upstream = [r for r in range(topo.world_size) if topo.coord(r).pp < topo.pp - 1]
        a = int(rng.choice(upstream))
        pair = (a, topo.pp_neighbor(a, 1))
        if band.startswith("slow_link"):
            return [{"kind": "slow_link", "ranks": list(pair), "factor": float(rng.uniform(1.5, 4))}], None, pair
        return [{"kind": "link_jitter", "ranks": list(pair), "sigma": float(rng.uniform(0.3, 1.0))}], None, pair
    return [], None, None


def _clock_skews(rng: np.random.Generator, world: int, count: int) -> list[dict]:
    """Offsets up to ±10 ms and drifts up to ±100 ppm on ``count`` ranks (never rank 0,
    the reference: its skew would only shift the whole timeline)."""
    ranks = rng.choice(np.arange(1, world), size=min(count, world - 1), replace=False)
    return [{"kind": "clock_skew", "rank": int(r), "offset_us": float(rng.uniform(-1e4, 1e4)),
             "drift_ppm": float(rng.uniform(-100, 100))} for r in ranks]


def make_trial(seed: int, index: int) -> Trial:
    rng = seeds.rng(seed, index)
    band = BANDS[int(rng.integers(len(BANDS)))]
    tp, pp, dp = _shape(rng, band.startswith(("slow_link", "link_jitter")))
    topo = Topology(tp=tp, pp=pp, dp=dp)
    faults, rank, pair = _fault(band, rng, topo)
    skewed = int(rng.integers(1, 4)) if band == "clock_skew only" else int(rng.integers(0, 3))
    faults += _clock_skews(rng, topo.world_size, skewed)
    scenario = parse_scenario({
        "name": f"trial{index}", "seed": int(rng.integers(2**31)), "iterations": 2,
        "parallel": {"tp": tp, "pp": pp, "dp": dp, "microbatches": max(4, 2 * pp)},
        "model": {"layers": 8, "hidden": 1024, "heads": 16, "seq_len": 1024},
        "cluster": {"jitter": {"compute_sigma": float(rng.uniform(0.01, 0.04)),
                               "link_sigma": float(rng.uniform(0.02, 0.1))}},
        "faults": faults})
    return Trial(index, band, scenario, rank, pair)


def matches(cause: RootCause, trial: Trial) -> bool:
    if trial.truth_rank is not None:
        return cause.rank == trial.truth_rank and cause.kind == "compute"
    if trial.truth_pair is not None:
        return cause.peer is not None and {cause.rank, cause.peer} == set(trial.truth_pair)
    return False


@dataclass(frozen=True)
class Outcome:
    trial: int
    band: str
    method: str
    reported: int
    correct_reported: int
    top1: bool
    found: bool


def scan_of_result(result: RunResult, name: str = "<sim>") -> ScanInput:
    """What a detector sees of a simulated run: per-rank Chrome events in each
    rank's local clock (as the run directory stores them), aligned again."""
    raw = [ev for r in sorted(result.events) for ev in chrome_events(
        r, result.label(r), result.events[r], result.clocks[r].local)]
    return prepare(events_from_chrome(raw, name), aligned=False, ref=0)


def run_trial(seed: int, index: int, run: RunScenario) -> tuple[list[Outcome], dict[str, float]]:
    """Run one trial with ``run`` (a backend's run function) and score every
    method on it, plus the clock alignment."""
    trial = make_trial(seed, index)
    result = run(trial.scenario)
    scan = scan_of_result(result, trial.scenario.name)
    truth = {str(r): {"offset_us": c.offset_us, "drift_ppm": c.drift_ppm} for r, c in result.clocks.items()}
    alignment = score_against_truth(scan.clocks, truth, ref=0)
    return [_outcome(trial, name, method(scan)) for name, method in METHODS.items()], alignment


def _outcome(trial: Trial, method: str, d: Diagnosis) -> Outcome:
    hits = [matches(c, trial) for c in d.root_causes]
    return Outcome(trial.index, trial.band, method, len(hits), sum(hits),
                   bool(hits) and hits[0], any(hits))


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


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def summarize(outcomes: Iterable[Outcome]) -> list[Row]:
    """Per method: one row per band, one for all faults, one for all controls."""
    groups: dict[tuple[str, str], list[Outcome]] = defaultdict(list)
    for o in outcomes:
        groups[(o.method, o.band)].append(o)
        groups[(o.method, "all controls" if o.band in CONTROLS else "all faults")].append(o)
    order = list(BANDS) + ["all faults", "all controls"]
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
        return Row(method, band, len(os_), None, None, None, _ratio(sum(o.reported > 0 for o in os_), len(os_)))
    return Row(method, band, len(os_), _ratio(sum(o.top1 for o in os_), len(os_)), precision,
               _ratio(sum(o.found for o in os_), len(os_)), None)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def write_csv(rows: list[Row], path: Path, option: str = "--csv") -> None:
    """The accuracy table, written whole (a temporary renamed into place) or not at all."""
    with atomic_file(path, option, make_parent=True) as tmp, open(tmp, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["method", "band", "trials", "top1", "precision", "recall", "fpr"])
        for r in rows:
            w.writerow([r.method, r.band, r.trials] + ["" if v is None else f"{v:.4f}" for v in
                                                         (r.top1, r.precision, r.recall, r.fpr)])


def markdown_table(rows: list[Row]) -> str:
    lines = ["| method | band | trials | top-1 | precision | recall | false-positive rate |",
             "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.method} | {r.band} | {r.trials} | {_pct(r.top1)} | {_pct(r.precision)} | "
              f"{_pct(r.recall)} | {_pct(r.fpr)} |" for r in rows]
    return "\n".join(lines)


def run_trials(seed: int, trials: int, where: Where, run: RunScenario,
               on_done: Callable[[], None] = lambda: None) -> Iterator[tuple[list[Outcome], dict]]:
    """Every trial's outcomes, in completion order, wherever ``where`` says
    (``run`` must be a module-level function: it is pickled)."""
    tasks = [(seed, i, run) for i in range(trials)]
    yield from map_unordered(_run_trial_star, tasks, where, on_done)


def _run_trial_star(args: tuple[int, int, RunScenario]) -> tuple[list[Outcome], dict]:
    return run_trial(*args)


def alignment_summary(scores: list[dict[str, float]]) -> dict[str, float]:
    worst = [s["offset_err_max_us"] for s in scores]
    drift = [s["drift_err_max_ppm"] for s in scores]
    med = [s["offset_err_median_us"] for s in scores]
    return {"trials": len(scores), "offset_err_median_us": float(np.median(med)) if med else math.nan,
            "offset_err_worst_us": max(worst, default=math.nan),
            "drift_err_worst_ppm": max(drift, default=math.nan)}
