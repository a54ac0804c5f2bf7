"""Everything about MegaScan's labelled sets lives here: runs beside what was
injected into them and what their traces show of it.

Three sources, one shape (``LabelledRun``):

- a recorded set of real traces (the tuning zoo, ``experiments.zoo_tuning``;
  the frozen held-out sets, ``tests/data/heldout`` and the later
  ``tests/data/heldout2``): a folder per run and a ``manifest.json`` with
  each run's faults and their realized effects;
- simulated trials (``trials.SIM``), run on demand;
- kept torch-backend trials (``validate-detector --backend torch --save-runs``).

Which runs a goal counts (``eligible``): a rank fault whose realized
slowdown is at least ``MIN_SLOWDOWN`` (the slowed rank's compute over its
peers', or 1 + a stall's share of the iteration; a simulated trial's
injected factor, which it realizes exactly), a link at least
``MIN_LINK_MS`` slower per message than the job's other links (a simulated
one at least ``MIN_SLOWDOWN`` times slower); a healthy run where the
machine alone made no straggler that large (no rank's realized compute over
its peers' at ``MIN_SLOWDOWN`` or more, measured as an injected slowdown is:
on a loaded machine about half the recorded healthy runs hold one, and a
detector that names it is right, not alarmed). Healthy runs that do hold one
are kept apart (``STRAGGLED``) and reported, not counted.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from megatronapp.faults import ground_truth
from megatronapp.io import gate
from megatronapp.scan.align.inputs import ScanInput, load_scan_input
from megatronapp.scan.eval.trials import SIM, Trial, TrialPlan
from megatronapp.scan.ingest.work import job_of
from megatronapp.scenario.config import fault_job

Truth = tuple[str, int, int | None]  # ("rank", rank, None) or ("link", low, high)
MIN_SLOWDOWN = 1.3  # the goals count rank faults at least this slow (the bar)
MIN_LINK_MS = 3.0  # ... and links at least this much slower per message
RANK_KINDS = ("slow_rank", "extra_calls", "noisy_neighbour", "loader_stall",
              "optimizer_step_stall")
STALLS = ("loader_stall", "optimizer_step_stall")
STRAGGLED = "healthy, machine straggler"  # a healthy run the goals do not count (above)


@dataclass(frozen=True)
class LabelledRun:
    name: str
    source: str  # heldout | tuning-zoo | sim | real
    job: str
    label: str  # the fault as a short text: "healthy", "slow-2x", ...
    truth: tuple[Truth, ...]
    realized: float  # the smallest realized slowdown (or link ms) of its faults; nan: unknown
    eligible: bool  # counted by the goals (see the module docstring)
    records_peers: bool  # the trace says who each point-to-point message went to
    load: Callable[[], ScanInput]

    @property
    def healthy(self) -> bool:
        return not self.truth

    @property
    def category(self) -> str:
        """rank fault | host stall | intermittent | two faults | link | healthy"""
        if not self.truth:
            return "healthy" if self.eligible else STRAGGLED
        if len(self.truth) > 1:
            return "two faults"
        if self.truth[0][0] == "link":
            return "link"
        return self.label


# ---------------------------------------------------------- recorded sets
def recorded(folder: Path, source: str) -> list[LabelledRun]:
    """The runs of a recorded set (its ``manifest.json``)."""
    manifest = gate.read_json(folder / "manifest.json", "recorded set")
    return [_recorded_run(folder, source, entry) for entry in manifest["runs"]]


def _recorded_run(folder: Path, source: str, entry: dict[str, Any]) -> LabelledRun:
    faults = entry["faults"]
    truth: list[Truth] = []
    effects: list[float] = []
    linked = False
    for f in faults:
        seen = entry["realized"].get(f["kind"], {})
        if f["kind"] == "slow_link":
            lo, hi = sorted((int(f["sender"]), int(f["receiver"])))
            truth.append(("link", lo, hi))
            effects.append(_link_ms(seen, f))
            linked = True
        else:
            for r in f["ranks"]:
                truth.append(("rank", int(r), None))
                effects.append(_slowdown(f["kind"], seen, int(r)))
    eligible = all((e >= MIN_LINK_MS if t[0] == "link" else e >= MIN_SLOWDOWN)
                   for t, e in zip(truth, effects))
    label = "healthy" if not faults else entry["run"].removeprefix(entry["job"] + "-")
    run_dir = folder / entry["run"]
    return LabelledRun(entry["run"], source, entry["job"], _short(label), tuple(truth),
                       min(effects) if effects else float("nan"),
                       eligible if faults else not _machine_straggler(entry),
                       bool(entry.get("record_shapes")) or not linked,
                       lambda: load_scan_input(run_dir))


def _machine_straggler(entry: dict[str, Any]) -> bool:
    """Whether the machine alone slowed a rank of a healthy run as much as
    the goals ask an injected fault to."""
    return float(entry["realized"].get("max_compute_over_peers", 1.0)) >= MIN_SLOWDOWN


def _short(label: str) -> str:
    """A run's label without the draw's index (healthy-2 -> healthy; link-forward-plain)."""
    return "healthy" if label.startswith("healthy") else label


def _slowdown(kind: str, seen: dict[str, Any], rank: int) -> float:
    if kind in STALLS:
        return 1.0 + float(seen.get("outside_ops_excess_share", {}).get(str(rank), 0.0))
    return float(seen.get("compute_over_peers", {}).get(str(rank), float("nan")))


def _link_ms(seen: dict[str, Any], fault: dict[str, Any]) -> float:
    pair, others = seen.get("pair_wait_ms"), seen.get("other_pairs_wait_ms")
    if pair is not None and others is not None:
        return float(pair) - float(others)
    return float(fault.get("nominal_delay_ms", float("nan")))


# ---------------------------------------------------------- simulated trials
def simulated(seed: int, trials: int, run: Callable[[Any], Any], plan: TrialPlan = SIM
              ) -> Iterator[LabelledRun]:
    """``trials`` simulated trials of ``plan`` (``run``: the simulator)."""
    from megatronapp.scan.eval.validate import scan_of_result

    for index in range(trials):
        trial = plan.make(seed, index)

        def load(t: Trial = trial) -> ScanInput:
            return replace(scan_of_result(run(t.scenario), t.scenario.name),
                           scenario=t.scenario)
        yield _trial_run(trial, f"{plan.name}{seed}-{index}", "sim", load)


def _trial_run(trial: Trial, name: str, source: str, load: Callable[[], ScanInput]
               ) -> LabelledRun:
    truth: tuple[Truth, ...] = ()
    factor = float("nan")
    if trial.truth_rank is not None:
        truth = (("rank", trial.truth_rank, None),)
    elif trial.truth_pair is not None:
        lo, hi = sorted(trial.truth_pair)
        truth = (("link", lo, hi),)
    for injected in ground_truth(trial.scenario.faults, fault_job(trial.scenario)):
        if injected.effect in ("compute", "link") and injected.unit == "x":  # a slowdown
            factor = injected.injected
    p = trial.scenario.parallel
    return LabelledRun(name, source, f"tp{p.tp} pp{p.pp} dp{p.dp}", trial.band, truth,
                       factor, not truth or not factor < MIN_SLOWDOWN, True, load)


def kept_trials(corpus: Path) -> list[LabelledRun]:
    """Trials kept by ``validate-detector --save-runs`` (torch or simulated)."""
    from megatronapp.scan.eval.trials import PLANS
    from megatronapp.scan.eval.validate import TRIAL_FILE, saved_trials

    out = []
    for run_dir in saved_trials(corpus):
        meta = gate.read_json(run_dir / TRIAL_FILE, "kept trial")
        trial = PLANS[meta["plan"]].make(int(meta["seed"]), int(meta["index"]))
        out.append(_trial_run(trial, f"{corpus.name}/{run_dir.name}", "real",
                              _loader(run_dir, trial)))
    return out


def _loader(run_dir: Path, trial: Trial) -> Callable[[], ScanInput]:
    """A kept trial as ``validate-detector`` scores it: with its job's
    scenario, as a run directory's summary records it (never its faults)."""
    return lambda: replace(load_scan_input(run_dir), scenario=job_of(trial.scenario))
