"""Real clocks, pair by pair, then all at once.

On a real trace nothing is exactly simultaneous, so each pair of ranks that
communicates gets its own estimate of how one clock maps onto the other,
from what is symmetric between them:

- transfers in both directions: the widest-margin line between "my receive
  ended after your send started" and the mirror bound (a link delays both
  directions alike, so the tightest bounds on both sides sit at the same
  distance from the truth); its uncertainty is the band it leaves;
- collectives they share (only between ranks no chain of transfers ties):
  completions nearly coincide, except when a thread is descheduled and
  leaves late. The offset is the middle of the tightest half of the
  completion differences (the shortest half), kept inside the pair's causal
  bounds.

The estimates are combined by weighted least squares over the graph of pairs
(ranks already known stay fixed), so no chain of stages piles up its errors
and what transfers tie together stays tied.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from itertools import combinations
from typing import Callable, Mapping

import numpy as np

from megatronapp.scan.align.bounds import MIN_SLOPE_SPAN_S, Bounds, maximin_line
from megatronapp.scan.align.components import component_labels
from megatronapp.scan.ingest.deps import SyncOp
from megatronapp.scan.ingest.load import RankEvents

MIN_SIGMA_S = 2e-6  # no pair estimate is trusted beyond timestamp noise
COMPLETIONS_DISCOUNT = 1e3  # a completions estimate's sigma, scaled against transfers'


@dataclass(frozen=True)
class PairEstimate:
    """``t_i = (1 + s)·t_j + c`` between two local clocks; ``sigma`` in seconds."""

    i: int
    j: int
    s: float
    c: float
    sigma: float
    slope_known: bool
    by_transfers: bool = True  # else from collective completions


def shorth(values: np.ndarray) -> tuple[float, float]:
    """(midpoint, width) of the shortest window holding half the values (the
    larger half when odd): the tightest agreeing half, whatever the rest does."""
    v = np.sort(values)
    h = (len(v) + 1) // 2
    widths = v[h - 1:] - v[:len(v) - h + 1]
    k = int(np.argmin(widths))
    return float(v[k] + v[k + h - 1]) / 2, float(widths[k])


# (j, i, ops) -> the causal bounds on j's clock against i's own local clock
BoundsOf = Callable[[int, int, list[SyncOp]], Bounds]


def _split_halves(bounds: Bounds) -> tuple[Bounds, Bounds]:
    cut = float(np.median(np.concatenate([bounds.lower_x, bounds.upper_x])))
    lo_a, up_a = bounds.lower_x < cut, bounds.upper_x < cut
    return (bounds.select(lo_a, up_a), bounds.select(~lo_a, ~up_a))


def _pair_transfers(i: int, j: int, ops: list[SyncOp], bounds_of: BoundsOf
                    ) -> PairEstimate | None:
    """Transfers in both directions; the uncertainty is how far the estimates
    from the run's two halves disagree (a steady delay, however long, is
    symmetric and agrees with itself)."""
    bounds = bounds_of(j, i, ops).p2p_only()
    if not bounds.two_sided:
        return None
    a, b, _ = maximin_line(bounds)
    x = np.concatenate([bounds.lower_x, bounds.upper_x])
    mid = float(np.median(x))
    halves = [h for h in _split_halves(bounds) if h.two_sided]
    if len(halves) == 2:
        (a1, b1, _), (a2, b2, _) = (maximin_line(h) for h in halves)
        sigma = abs((a1 - a2) * mid + (b1 - b2)) / 2
    else:
        sigma = abs(maximin_line(bounds)[2]) / math.sqrt(3)
    return PairEstimate(i, j, a - 1.0, b, max(sigma, MIN_SIGMA_S),
                        float(np.ptp(x)) >= MIN_SLOPE_SPAN_S)


def _pair_collectives(i: int, j: int, ops: list[SyncOp], events: RankEvents,
                      bounds_of: BoundsOf) -> PairEstimate | None:
    """Completions of the collectives both joined: robust line, kept inside
    the pair's own causal bounds; uncertainty from the residuals' robust
    spread over the root of their number."""
    x, y = [], []
    for op in ops:
        ends = {r: events[r][k].end_s for r, k in op.members}
        x.append(ends[j])
        y.append(ends[i])
    if not x:
        return None
    xs, ys = np.array(x), np.array(y)
    mid, width = shorth(ys - xs)  # an offset only: a few noisy completions cannot show drift
    c = bounds_of(j, i, ops).clip(1.0, mid)
    resid = ys - xs - c
    spread = 1.4826 * float(np.median(np.abs(resid - np.median(resid))))
    return PairEstimate(i, j, 0.0, c, max(spread / math.sqrt(len(xs)), width / 2, MIN_SIGMA_S),
                        False, by_transfers=False)


def pair_estimates(events: RankEvents, ops: list[SyncOp], free: set[int],
                   bounds_of: BoundsOf) -> list[PairEstimate]:
    """Every estimate between two ranks, at least one of them in ``free``."""
    p2p: dict[tuple[int, int], list[SyncOp]] = defaultdict(list)
    coll: dict[tuple[int, int], list[SyncOp]] = defaultdict(list)
    for op in ops:
        ranks = sorted(set(op.ranks))
        if len(ranks) < 2:
            continue
        for i, j in combinations(ranks, 2):
            if i in free or j in free:
                (p2p if op.kind == "p2p" else coll)[(i, j)].append(op)
    out = []
    for (i, j), pair_ops in p2p.items():
        est = _pair_transfers(i, j, pair_ops, bounds_of)
        if est is not None:
            out.append(est)
    component = transfer_components(sorted(events), out)
    for (i, j), pair_ops in coll.items():
        if component[i] == component[j]:
            continue  # transfers already tie them, far tighter than completions do
        est = _pair_collectives(i, j, pair_ops, events, bounds_of)
        if est is not None:
            out.append(est)
    return out


def transfer_components(ranks: list[int], estimates: list[PairEstimate]) -> dict[int, int]:
    """rank -> a label shared by the ranks tied to it by transfers."""
    tied = np.array([(e.i, e.j) for e in estimates if e.by_transfers], np.int64).reshape(-1, 2)
    return dict(zip(ranks, component_labels(ranks, tied[:, 0], tied[:, 1]).tolist()))


def combine(estimates: list[PairEstimate], fixed: Mapping[int, tuple[float, float]],
            free: list[int]) -> dict[int, tuple[float, float]]:
    """(s, c) of every free rank reached by an estimate: weighted least squares
    of ``c_j - c_i = c`` and ``s_j - s_i = s`` over the pairs. Collective
    completions weigh next to nothing against transfers: they only place
    what transfers leave free (one group of ranks tied by transfers against
    another)."""
    index = {r: k for k, r in enumerate(free)}
    reached = {r for e in estimates for r in (e.i, e.j) if r in index}
    if not reached:
        return {}
    solved = {}
    for part in (1, 0):  # intercepts, then slopes
        rows, rhs = [], []
        for e in estimates:
            if part == 0 and not e.slope_known:
                continue
            row = np.zeros(len(free))
            value = e.c if part else e.s
            known = True
            for rank, sign in ((e.j, 1.0), (e.i, -1.0)):
                if rank in index:
                    row[index[rank]] += sign
                elif rank in fixed:
                    value -= sign * fixed[rank][part]
                else:
                    known = False
            if known and row.any():
                sigma = e.sigma * (1.0 if e.by_transfers else COMPLETIONS_DISCOUNT)
                rows.append(row / sigma)
                rhs.append(value / sigma)
        if rows:
            solution = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)[0]
        else:
            solution = np.zeros(len(free))
        solved[part] = solution
    return {r: (float(solved[0][index[r]]), float(solved[1][index[r]])) for r in reached}
