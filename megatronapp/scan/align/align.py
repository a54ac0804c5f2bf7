"""Clock alignment from matched communications.

Each rank's local clock maps to the reference rank's clock by a line
``ref = a·local + b`` (offset and drift), fitted breadth-first from the
reference against the already fitted members of the ops it shares (over
columns: ``table.fit_clocks``; the lines, the causal bounds and the solver
of freed ranks are here).

Where every member of a synchronous op *finishes* at the same moment (start
times differ: they carry the straggler signal), completion times are anchor
points, fitted by outlier-trimmed least squares. Real collectives release
their members at different times and a receive may end long after delivery,
so a fit is kept only when its anchors agree to a microsecond and it breaks
no causal bound; otherwise the rank is fitted to the causal bounds alone
(``bounds.py``: a receive ends after its send started, nobody leaves an
all-reduce before the last member arrived).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from megatronapp.scan.align.bounds import Bounds, all_to_all, maximin_line
from megatronapp.scan.ingest.deps import SyncOp
from megatronapp.scan.ingest.load import RankEvents
from megatronapp.scan.align.pairwise import combine, pair_estimates, transfer_components

MIN_TRIM_S = 2e-7  # residuals below this are timestamp rounding, never outliers
# A receive posted after its message arrived ends when posted, not at delivery:
# only receives that waited at least this long are completion anchors.
MIN_RECV_WAIT_S = 1e-6
# Completions that coincide to within this (median residual) are synchronous
# (the simulator, or a clean trace); anything looser is fitted by causal bounds.
ANCHOR_SPREAD_S = 1e-6
MIN_JUDGED_ANCHORS = 4  # a line through fewer anchors says nothing of how well they agree


@dataclass(frozen=True)
class ClockFit:
    """ref_time = a·local + b, i.e. offset_us and drift_ppm relative to the reference."""

    a: float = 1.0
    b: float = 0.0
    anchors: int = 0  # sync ops (or causal bounds) the fit used
    method: str = "anchors"  # "anchors": completions coincide; "bounds": causal bounds

    def to_ref(self, local_s: float) -> float:
        return self.a * local_s + self.b

    def to_ref_array(self, local_s: np.ndarray) -> np.ndarray:
        return self.a * local_s + self.b

    @property
    def drift_ppm(self) -> float:
        return (1.0 / self.a - 1.0) * 1e6

    @property
    def offset_us(self) -> float:
        return -self.b / self.a * 1e6


def _paired_slope(dx: np.ndarray, dev: np.ndarray) -> tuple[float, float]:
    """Outlier-proof start: median slope between points half the sample apart
    (a cheap Theil-Sen), then the median intercept."""
    order = np.argsort(dx)
    dx, dev = dx[order], dev[order]
    half = len(dx) // 2
    run = dx[half:2 * half] - dx[:half]
    ok = run > 0
    slope = float(np.median((dev[half:2 * half] - dev[:half])[ok] / run[ok])) if ok.any() else 0.0
    return slope, float(np.median(dev - slope * dx))


def robust_line(x: np.ndarray, y: np.ndarray, rounds: int = 6) -> tuple[float, float]:
    """Fit y = a·x + b, fitting the small deviation y - x to keep precision."""
    x0 = float(np.median(x))
    dx, dev = x - x0, y - x
    slope, icpt = _paired_slope(dx, dev)
    keep = np.ones(len(x), dtype=bool)
    for round_ in range(rounds):
        resid = dev - (slope * dx + icpt)
        mad = float(np.median(np.abs(resid[keep] - np.median(resid[keep]))))
        new_keep = np.abs(resid) <= max(5 * 1.4826 * mad, MIN_TRIM_S)
        if new_keep.sum() < 2 or (round_ > 0 and (new_keep == keep).all()):
            break
        keep = new_keep
        if np.ptp(dx[keep]) > 0:
            slope, icpt = np.polyfit(dx[keep], dev[keep], 1)
        else:
            slope, icpt = 0.0, float(np.median(dev[keep]))
    a = 1.0 + float(slope)
    return a, float(icpt) - float(slope) * x0


def causal_bounds(rank: int, ops: list[SyncOp], events: RankEvents,
                  fits: Mapping[int, ClockFit]) -> Bounds:
    """Half-planes on ``rank``'s clock from its sync ops with fitted ranks."""
    lx: list[float] = []
    ly: list[float] = []
    ux: list[float] = []
    uy: list[float] = []
    lp: list[bool] = []
    up: list[bool] = []
    for op in ops:
        members = [(r, events[r][i]) for r, i in op.members]
        others = [(r, e) for r, e in members if r != rank and r in fits]
        mine = [e for r, e in members if r == rank]
        if not others or not mine:
            continue
        if op.kind == "p2p":
            (s, send), (_, recv) = members
            if s == rank:  # my send started before the receive ended
                ux.append(send.start_s)
                uy.append(fits[others[0][0]].to_ref(recv.end_s))
                up.append(True)
            else:  # my receive ended after the send started
                lx.append(recv.end_s)
                ly.append(fits[others[0][0]].to_ref(send.start_s))
                lp.append(True)
        elif all_to_all(op.name):
            # I left after the last of them arrived; I arrived before the first left.
            lx.append(mine[0].end_s)
            ly.append(max(fits[r].to_ref(e.start_s) for r, e in others))
            ux.append(mine[0].start_s)
            uy.append(min(fits[r].to_ref(e.end_s) for r, e in others))
            lp.append(False)
            up.append(False)
    return Bounds(np.array(lx), np.array(ly), np.array(ux), np.array(uy),
                  np.array(lp, dtype=bool), np.array(up, dtype=bool))


@dataclass(frozen=True)
class AnchorFit:
    fit: ClockFit
    spread_s: float  # median distance of its anchors from the line
    anchors: int

    @classmethod
    def through(cls, xs: np.ndarray, ys: np.ndarray) -> "AnchorFit":
        """The outlier-trimmed line through (local completion, reference completion)."""
        if not len(xs):
            return cls(ClockFit(), math.inf, 0)
        a, b = robust_line(xs, ys)
        return cls(ClockFit(a, b, len(xs)), float(np.median(np.abs(ys - (a * xs + b)))), len(xs))


def completions_coincide(anchored: Mapping[int, AnchorFit]) -> bool:
    """Whether this trace's completions are synchronous: the ranks with
    enough anchors to tell (more than a line's two parameters) fit them to a
    microsecond. With none able to tell, they are taken to be."""
    judged = [f.spread_s for f in anchored.values() if f.anchors >= MIN_JUDGED_ANCHORS]
    return not judged or float(np.median(judged)) <= ANCHOR_SPREAD_S


def freed_ranks(anchored: Mapping[int, AnchorFit], violation: Callable[[int], float]
                ) -> list[int]:
    """Ranks whose anchor fit cannot stand: every one when the trace's
    completions do not coincide, else those without anchors or whose fit
    breaks a causal bound (``violation(rank)``: by how much, in seconds)."""
    synchronous = completions_coincide(anchored)
    return [r for r, f in anchored.items()
            if not synchronous or f.anchors == 0 or violation(r) > MIN_TRIM_S]


def solve_freed(events: RankEvents, ops: list[SyncOp], fits: Mapping[int, ClockFit],
                free: list[int]) -> dict[int, ClockFit]:
    """``fits`` with the ``free`` ranks solved from pairwise estimates and
    causal bounds (``ops``: the sync ops of 2+ members)."""
    ops_of: dict[int, list[SyncOp]] = defaultdict(list)
    for op in ops:
        for r in set(op.ranks):
            ops_of[r].append(op)
    out = {r: ClockFit(f.a, f.b, f.anchors, "bounds") if r in free else f
           for r, f in fits.items()}
    out.update(_solve_real_clocks(events, ops, ops_of, out, free))
    return out


def _solve_real_clocks(events: RankEvents, ops: list[SyncOp], ops_of: Mapping[int, list[SyncOp]],
                       fits: dict[int, ClockFit], free: list[int]) -> dict[int, ClockFit]:
    def bounds_of(j: int, i: int, pair_ops: list[SyncOp]) -> Bounds:
        return causal_bounds(j, pair_ops, events, {i: ClockFit()})

    fixed = {r: (f.a - 1.0, f.b) for r, f in fits.items() if f.method != "bounds"}
    estimates = pair_estimates(events, ops, set(free), bounds_of)
    solved = combine(estimates, fixed, free)
    out = {r: ClockFit(1.0 + s, c, fits[r].anchors, "bounds") for r, (s, c) in solved.items()}
    component = transfer_components(sorted(events), estimates)
    groups: dict[int, list[int]] = defaultdict(list)
    for r in out:
        groups[component[r]].append(r)
    everyone = {**fits, **out}
    for members in groups.values():
        if any(component[r] == component[f] for f in fixed for r in members):
            continue  # tied by transfers to a rank already placed
        shift = _component_shift(members, ops_of, events, everyone)
        for r in members:
            out[r] = ClockFit(out[r].a, out[r].b + shift, out[r].anchors, "bounds")
            everyone[r] = out[r]
    return out


def _component_shift(members: list[int], ops_of: Mapping[int, list[SyncOp]], events: RankEvents,
                     everyone: Mapping[int, ClockFit]) -> float:
    """How far a group of ranks tied by transfers must move, all together,
    to keep every causal bound against the ranks outside it (0 if none)."""
    inside = set(members)
    outside = {r: f for r, f in everyone.items() if r not in inside}
    low, high = -math.inf, math.inf
    for r in members:
        b = causal_bounds(r, ops_of.get(r, []), events, outside)
        fit = everyone[r]
        if len(b.lower_x):
            low = max(low, float(np.max(b.lower_y - fit.to_ref_array(b.lower_x))))
        if len(b.upper_x):
            high = min(high, float(np.min(b.upper_y - fit.to_ref_array(b.upper_x))))
    if low > high:
        return (low + high) / 2
    return min(max(0.0, low), high)


def trace_span(events: RankEvents) -> tuple[float, float]:
    """First start and last end over every rank (in the events' clock)."""
    starts = [e.start_s for ev in events.values() for e in ev]
    ends = [e.end_s for ev in events.values() for e in ev]
    return (min(starts), max(ends)) if starts else (0.0, 0.0)
