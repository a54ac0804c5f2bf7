"""Everything about fitting MegaScan's parameters and scoring it on a set of
runs lives here: a run's evidence beside its truth (``Case``), the verdict
each run gets under given parameters, the scores over a set, the fit of the
thresholds and of the confidence's calibration, and the calibration's
reliability (expected calibration error, reliability bins).

A set's truth is read here and nowhere in the detector: the evidence is
what the detector made of the trace alone (``Detector.evidence``).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence

import numpy as np

from megatronapp.scan.diagnosis import RootCause
from megatronapp.scan.evidence.detect import (Evidence, delayed, judge, merge_key, merged,
                                              named_iterations, without_cost)
from megatronapp.scan.evidence.params import Params
from megatronapp.scan.eval.sets import LabelledRun, Truth

VERDICTS = ("right", "missed", "wrong", "false alarm", "quiet")


@dataclass(frozen=True)
class Case:
    """One labelled run and what MegaScan's detector saw in it (``Detector.evidence``)."""

    run: LabelledRun
    evidence: tuple[Evidence, ...]
    links: frozenset[tuple[int, int]] = frozenset()  # pairs that exchanged a transfer

    @property
    def truth(self) -> tuple[Truth, ...]:
        return self.run.truth


def matches(cause: RootCause, truth: Truth) -> bool:
    if truth[0] == "link":
        return cause.kind == "link" and {cause.rank, cause.peer} == {truth[1], truth[2]}
    return cause.kind != "link" and cause.rank == truth[1]


@dataclass(frozen=True)
class Outcome:
    run: LabelledRun
    verdict: str  # right | missed | wrong (a fault) ; false alarm | quiet (healthy)
    causes: tuple[RootCause, ...]
    all_named: bool  # every injected fault named (two faults at once: both)
    phantom: bool  # a link named between ranks that exchanged no transfer
    wrong_link: bool  # a link named that is not the injected one
    # with the devices and links slow at no cost listed after the causes: the
    # first of them all is an injected fault (faulted run), anything at all (healthy)
    flagged_first: bool = False
    flagged: bool = False

    @property
    def faulted(self) -> bool:
        return bool(self.run.truth)


def outcome_of(run: LabelledRun, causes: Sequence[RootCause],
               links: frozenset[tuple[int, int]] | None = None,
               slow: Sequence[RootCause] = ()) -> Outcome:
    """What a method's causes (most confident first) make of a run (``slow``:
    what it lists as slow at no cost, after them)."""
    causes = tuple(causes)
    listed = causes + tuple(slow)
    first = bool(listed) and any(matches(listed[0], t) for t in run.truth)
    return replace(_verdict(run, causes, links), flagged=bool(listed), flagged_first=first)


def _verdict(run: LabelledRun, causes: tuple[RootCause, ...],
             links: frozenset[tuple[int, int]] | None) -> Outcome:
    named_links = [(min(c.rank, c.peer or 0), max(c.rank, c.peer or 0)) for c in causes
                   if c.kind == "link"]
    phantom = links is not None and any(pair not in links for pair in named_links)
    wrong_link = any(not any(t[0] == "link" and pair == (t[1], t[2]) for t in run.truth)
                     for pair in named_links)
    if not run.truth:
        return Outcome(run, "false alarm" if causes else "quiet", causes, True, phantom,
                       wrong_link)
    if not causes:
        return Outcome(run, "missed", causes, False, phantom, wrong_link)
    right = any(matches(causes[0], t) for t in run.truth)
    every = all(any(matches(c, t) for c in causes[:len(run.truth)]) for t in run.truth)
    return Outcome(run, "right" if right else "wrong", causes, every, phantom, wrong_link)


def outcome(case: Case, p: Params) -> Outcome:
    causes = merged(judge(case.evidence, p))
    return outcome_of(case.run, causes, case.links, without_cost(case.evidence, causes, p))


@dataclass(frozen=True)
class Scores:
    faulted: int
    named_first: int  # the first cause is an injected fault
    missed: int
    wrong: int
    healthy: int
    false_alarms: int
    multi: int  # runs with several faults
    multi_all: int  # ... every one named
    phantoms: int

    @property
    def named_rate(self) -> float:
        return self.named_first / self.faulted if self.faulted else float("nan")

    @property
    def false_alarm_rate(self) -> float:
        return self.false_alarms / self.healthy if self.healthy else float("nan")


def scores(outcomes: Sequence[Outcome]) -> Scores:
    """Counts over the runs the goals count (``LabelledRun.eligible``)."""
    outcomes = [o for o in outcomes if o.run.eligible]
    faulted = [o for o in outcomes if o.faulted]
    healthy = [o for o in outcomes if not o.faulted]
    multi = [o for o in faulted if len(o.run.truth) > 1]
    return Scores(len(faulted), sum(o.verdict == "right" for o in faulted),
                  sum(o.verdict == "missed" for o in faulted),
                  sum(o.verdict == "wrong" for o in faulted), len(healthy),
                  sum(o.verdict == "false alarm" for o in healthy), len(multi),
                  sum(o.all_named for o in multi), sum(o.phantom for o in outcomes))


# ------------------------------------------------------------------ fit
@dataclass(frozen=True)
class Fit:
    params: Params
    tuning: Scores
    grid: tuple[tuple[float, ...], ...] = field(default=())  # (*thresholds, named, fa)


# min_slowdown stays below 0.3: MegaScan is asked to name ranks slowed 1.3x,
# which a threshold at 0.3 would miss by construction whatever the noise
GRID: Mapping[str, Sequence[float]] = {
    "noise_multiple": (1, 1.5, 2, 3, 4, 6, 8),
    "min_slowdown": (0.0, 0.1, 0.15, 0.2, 0.25),
    "min_share": (0.0, 0.003, 0.01, 0.03, 0.05),
    "recur_multiple": (3, 5, 10, 20, 50, 100, 1000)}


@dataclass(frozen=True)
class _Suspect:
    """One suspect's figures as arrays, for judging it under many parameters."""

    rank_key: tuple[object, ...]  # ("rank", r) or ("link", low, high): what merging groups by
    truth: bool
    units: np.ndarray
    slowdown: np.ndarray
    blame: np.ndarray
    delay: np.ndarray
    elapsed: np.ndarray


def _suspects(case: Case) -> list[_Suspect]:
    out = []
    for e in case.evidence:
        key = merge_key(e)
        truth = any((t[0] == "link" and key == ("link", t[1], t[2])) or
                    (t[0] == "rank" and key == ("rank", t[1])) for t in case.run.truth)
        out.append(_Suspect(key, truth, e.units, e.slowdown, e.blame, e.delay, e.elapsed))
    return out


def _fast_verdict(run: LabelledRun, suspects: list[_Suspect], p: Params) -> tuple[str, bool]:
    """``outcome``'s verdict and whether every fault was named, without
    building causes (what ``fit_thresholds`` asks of every grid point)."""
    best: dict[tuple[object, ...], tuple[float, float, bool]] = {}
    for s in suspects:
        hit = ((s.units >= p.noise_multiple) & (s.slowdown >= p.min_slowdown)
               & delayed(s.delay, s.elapsed, p))
        hit = named_iterations(s.units, hit, p)
        if not hit.any():
            continue
        confidence = float(np.mean(s.units[hit]))  # calibrated() is monotone in it
        blame = float(np.mean(s.blame[hit]))
        old = best.get(s.rank_key)
        if old is None:
            best[s.rank_key] = (confidence, blame, s.truth)
        else:  # merged: the larger blame leads, the higher confidence stands
            best[s.rank_key] = (max(confidence, old[0]), max(blame, old[1]), s.truth or old[2])
    ranked = sorted(best.values(), key=lambda v: (-v[0], -v[1]))
    if not run.truth:
        return ("false alarm" if ranked else "quiet"), True
    if not ranked:
        return "missed", False
    named = {k for k, v in best.items() if v[2] and v in ranked[:len(run.truth)]}
    return ("right" if ranked[0][2] else "wrong"), len(named) >= len(run.truth)


def _fast_scores(prepared: list[tuple[LabelledRun, list[_Suspect]]], p: Params
                 ) -> tuple[float, float]:
    faulted = named = healthy = alarms = 0
    for run, suspects in prepared:
        if not run.eligible:
            continue
        verdict, _ = _fast_verdict(run, suspects, p)
        if run.truth:
            faulted += 1
            named += verdict == "right"
        else:
            healthy += 1
            alarms += verdict == "false alarm"
    return (named / faulted if faulted else float("nan"),
            alarms / healthy if healthy else float("nan"))


def fit_thresholds(cases: Sequence[Case], base: Params = Params(),
                   grid: Mapping[str, Sequence[float]] = GRID,
                   max_false_alarms: float = 0.03) -> Fit:
    """The thresholds (``grid``) that name the most faults first while false
    alarms stay at most ``max_false_alarms`` of the healthy runs (ties: the
    fewest false alarms, then the larger thresholds, in ``grid``'s order)."""
    prepared = [(c.run, _suspects(c)) for c in cases]
    rows = []
    for values in itertools.product(*grid.values()):
        p = replace(base, **dict(zip(grid, values)))  # type: ignore[arg-type]
        rows.append((*values, *_fast_scores(prepared, p)))
    allowed = [r for r in rows if not r[-1] > max_false_alarms] or rows
    best = max(allowed, key=lambda r: (r[-2], -r[-1], *r[:-2]))
    params = replace(base, **dict(zip(grid, best[:-2])))  # type: ignore[arg-type]
    return Fit(params, scores([outcome(c, params) for c in cases]), tuple(rows))


# chance_count's grid; 1 makes only a suspect counting in every iteration persistent
CHANCES = (0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 1.0)


def fit_chance(cases: Sequence[Case], base: Params = Params(),
               values: Sequence[float] = CHANCES) -> tuple[Params, tuple[tuple[float, ...], ...]]:
    """``chance_count`` with the other thresholds held: the value naming the
    most faults first with no more false alarms than 1 (counting in every
    iteration) raises (ties: the larger value); and every value's (named, false
    alarm) rates."""
    prepared = [(c.run, _suspects(c)) for c in cases]
    rows = tuple((v, *_fast_scores(prepared, replace(base, chance_count=v)))
                 for v in sorted(set(values) | {1.0}))
    every = rows[-1]
    allowed = [r for r in rows if not r[2] > every[2]]
    best = max(allowed, key=lambda r: (r[1], r[0]))
    return replace(base, chance_count=best[0]), rows


def calibration_points(cases: Sequence[Case], p: Params) -> tuple[np.ndarray, np.ndarray]:
    """Every named cause's noise units and whether it was an injected fault."""
    units, right = [], []
    for c in cases:
        for cause in outcome(c, p).causes:
            units.append(float(cause.evidence["noise_units"]))
            right.append(any(matches(cause, t) for t in c.run.truth))
    return np.asarray(units), np.asarray(right, bool)


PRIOR = np.array([1.0, 0.0])  # slope and offset before any finding is seen
PRIOR_WEIGHT = 1.0  # a unit Gaussian prior: with few wrong findings the confidence stays graded


def fit_calibration(units: np.ndarray, right: np.ndarray, p: Params) -> Params:
    """The logistic slope and offset in log(units / noise_multiple) with the
    highest posterior for ``right`` under ``PRIOR`` (Newton's method, each
    step halved until the posterior rises: a full step from a start where
    the confidence saturates can overshoot and diverge): a set whose named
    causes are nearly all right would otherwise drive the slope to a step."""
    if not len(units):
        return p
    x = np.log(np.maximum(units, 1e-12)) - np.log(p.noise_multiple)
    design = np.stack([x, np.ones_like(x)], axis=1)
    right = np.asarray(right, float)

    def posterior(w: np.ndarray) -> float:
        z = design @ w  # log-likelihood of a logistic model, written to stay finite
        return float(np.sum(right * z - np.logaddexp(0.0, z))
                     - 0.5 * PRIOR_WEIGHT * np.sum((w - PRIOR) ** 2))

    w = PRIOR.copy()
    for _ in range(100):
        prob = 1.0 / (1.0 + np.exp(-np.clip(design @ w, -500, 500)))
        grad = design.T @ (right - prob) - PRIOR_WEIGHT * (w - PRIOR)
        hess = -(design.T * (prob * (1 - prob))) @ design - PRIOR_WEIGHT * np.eye(2)
        step = np.linalg.solve(hess, grad)
        now = posterior(w)
        while posterior(w - step) < now and np.max(np.abs(step)) > 1e-12:
            step = step / 2
        w = w - step
        if np.max(np.abs(step)) < 1e-9:
            break
    return replace(p, confidence_slope=float(w[0]), confidence_offset=float(w[1]))


def reliability(confidence: np.ndarray, right: np.ndarray, bins: int = 10
                ) -> tuple[float, list[tuple[float, float, int]]]:
    """Expected calibration error and, per confidence bin, (mean confidence,
    share right, count)."""
    edges = np.linspace(0, 1, bins + 1)
    which = np.clip(np.digitize(confidence, edges[1:-1]), 0, bins - 1)
    table, ece = [], 0.0
    for b in range(bins):
        mine = which == b
        if not mine.any():
            continue
        conf, acc = float(confidence[mine].mean()), float(right[mine].mean())
        table.append((conf, acc, int(mine.sum())))
        ece += mine.sum() / len(confidence) * abs(conf - acc)
    return ece, table
