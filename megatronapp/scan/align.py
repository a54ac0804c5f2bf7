"""Clock alignment from matched communications.

Every member of a synchronous op *finishes* at the same moment (start times
differ: they carry the straggler signal), so completion times are anchor
points. Each rank's local clock maps to the reference rank's clock by a line
``ref = a·local + b`` (offset and drift). Ranks are fitted in breadth-first
order from the reference, each against the already fitted members of the ops
it shares, with an outlier-trimmed least-squares fit.
"""
from __future__ import annotations

import statistics
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from megatronapp.tracer import Event

from .deps import SyncOp
from .load import RankEvents

MIN_TRIM_S = 2e-7  # residuals below this are timestamp rounding, never outliers
# A receive posted after its message arrived ends when posted, not at delivery:
# only receives that waited at least this long are completion anchors.
MIN_RECV_WAIT_S = 1e-6


def is_anchor(op: SyncOp, events: RankEvents) -> bool:
    if op.kind == "collective":
        return len(op.members) > 1
    rank, index = op.members[1]
    return events[rank][index].dur_s >= MIN_RECV_WAIT_S


@dataclass(frozen=True)
class ClockFit:
    """ref_time = a·local + b, i.e. offset_us and drift_ppm relative to the reference."""

    a: float = 1.0
    b: float = 0.0
    anchors: int = 0

    def to_ref(self, local_s: float) -> float:
        return self.a * local_s + self.b

    @property
    def drift_ppm(self) -> float:
        return (1.0 / self.a - 1.0) * 1e6

    @property
    def offset_us(self) -> float:
        return -self.b / self.a * 1e6


def _neighbours(ops: list[SyncOp]) -> dict[int, set[int]]:
    adj: dict[int, set[int]] = defaultdict(set)
    for op in ops:
        ranks = set(op.ranks)
        for r in ranks:
            adj[r] |= ranks - {r}
    return adj


def bfs_order(ranks: list[int], ops: list[SyncOp], ref: int) -> list[int]:
    adj, seen, order = _neighbours(ops), {ref}, [ref]
    queue = deque([ref])
    while queue:
        r = queue.popleft()
        for s in sorted(adj.get(r, ())):
            if s not in seen:
                seen.add(s)
                order.append(s)
                queue.append(s)
    return order + sorted(set(ranks) - seen)  # unconnected ranks keep their own clock


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


def fit_clocks(events: RankEvents, ops: list[SyncOp], ref: int | None = None) -> dict[int, ClockFit]:
    """One ClockFit per rank, mapping its local clock onto the reference rank's."""
    ranks = sorted(events)
    if not ranks:
        return {}
    ops = [op for op in ops if is_anchor(op, events)]
    ref = ranks[0] if ref is None else ref
    ops_of: dict[int, list[SyncOp]] = defaultdict(list)
    for op in ops:
        for r in set(op.ranks):
            ops_of[r].append(op)
    fits: dict[int, ClockFit] = {ref: ClockFit()}
    for rank in bfs_order(ranks, ops, ref)[1:]:
        xs, ys = [], []
        for op in ops_of.get(rank, ()):
            mine = [events[r][i].end_s for r, i in op.members if r == rank]
            anchors = [fits[r].to_ref(events[r][i].end_s) for r, i in op.members if r in fits]
            if mine and anchors:
                xs.append(mine[0])
                ys.append(statistics.median(anchors))
        if xs:
            a, b = robust_line(np.array(xs), np.array(ys))
            fits[rank] = ClockFit(a, b, len(xs))
        else:
            fits[rank] = ClockFit()
    return fits


def apply_clocks(events: RankEvents, fits: Mapping[int, ClockFit]) -> RankEvents:
    out: RankEvents = {}
    for rank, rank_events in events.items():
        fit = fits.get(rank, ClockFit())
        out[rank] = [Event(e.name, fit.to_ref(e.start_s), fit.a * e.dur_s, e.args)
                     for e in rank_events]
    return out


def score_against_truth(fits: Mapping[int, ClockFit], truth: Mapping[str, Any],
                        ref: int) -> dict[str, float]:
    """Offset (µs, at local time 0) and drift (ppm) errors against injected clocks.

    ``truth`` maps rank -> {offset_us, drift_ppm} with local = true·(1+d) + o.
    The reference rank's own skew is composed in, so errors are like for like.
    """
    def clock(rank: int) -> tuple[float, float]:
        c = truth.get(str(rank), {})
        return 1.0 + c.get("drift_ppm", 0.0) * 1e-6, c.get("offset_us", 0.0) * 1e-6

    ref_scale, ref_offset = clock(ref)
    offset_err, drift_err = [], []
    for rank, fit in fits.items():
        scale, offset = clock(rank)
        a_true = ref_scale / scale
        b_true = ref_offset - a_true * offset
        offset_err.append(abs(fit.b - b_true) * 1e6)
        drift_err.append(abs(fit.a - a_true) * 1e6)
    off, dr = np.array(offset_err), np.array(drift_err)
    return {"ranks": len(off), "offset_err_median_us": float(np.median(off)),
            "offset_err_max_us": float(off.max()), "drift_err_median_ppm": float(np.median(dr)),
            "drift_err_max_ppm": float(dr.max())}
