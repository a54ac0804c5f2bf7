"""Causal bounds on a rank's clock, and the line that keeps them best.

What a real trace guarantees, whatever the noise:

- a receive cannot end before its send started;
- no member of an all-to-all collective (all-reduce, all-gather,
  reduce-scatter, all-to-all, barrier) can leave before the last member
  arrived.

Against ranks whose clocks are already known, each such pair of events is a
half-plane for this rank's line ``ref = (1 + s)·local + b``: a *lower* bound
(this rank's event happened after the other's) or an *upper* one. Noise only
ever loosens these bounds (a late wake-up, a descheduled thread), so the
tightest of many are the information. The estimate is the line with the
widest margin to both sides at the drift the run's windows show, i.e.
midway between the tightest lower and upper bounds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Collectives whose every output depends on every member's input.
ALL_TO_ALL_WORDS = ("allreduce", "all_reduce", "allgather", "all_gather", "reducescatter",
                    "reduce_scatter", "alltoall", "all_to_all", "barrier")
MAX_DRIFT = 5e-4  # quartz clocks drift by tens of ppm: beyond ±500 ppm a slope is noise
MAD_TO_SIGMA = 1.4826


def all_to_all(name: str) -> bool:
    lowered = name.lower()
    return any(w in lowered for w in ALL_TO_ALL_WORDS)


@dataclass(frozen=True)
class Bounds:
    """Half-planes for one rank: ``(1+s)·x + b >= y`` (lower) and ``<= y`` (upper),
    x in the rank's local seconds, y in the reference's seconds."""

    lower_x: np.ndarray
    lower_y: np.ndarray
    upper_x: np.ndarray
    upper_y: np.ndarray
    lower_p2p: np.ndarray  # which bounds come from point-to-point transfers
    upper_p2p: np.ndarray

    def select(self, lower: np.ndarray, upper: np.ndarray) -> "Bounds":
        return Bounds(self.lower_x[lower], self.lower_y[lower], self.upper_x[upper],
                      self.upper_y[upper], self.lower_p2p[lower], self.upper_p2p[upper])

    def p2p_only(self) -> "Bounds":
        return self.select(self.lower_p2p, self.upper_p2p)

    def clip(self, a: float, b: float) -> float:
        """The intercept nearest ``b`` that keeps slope ``a`` inside every bound
        (midway when the bounds leave no room at this slope)."""
        low = float(np.max(self.lower_y - a * self.lower_x)) if len(self.lower_x) else -math.inf
        high = float(np.min(self.upper_y - a * self.upper_x)) if len(self.upper_x) else math.inf
        if low > high:
            return (low + high) / 2
        return min(max(b, low), high)

    @property
    def two_sided(self) -> bool:
        return len(self.lower_x) > 0 and len(self.upper_x) > 0

    def violation(self, a: float, b: float) -> float:
        """Largest amount (s) by which the line ``a·x + b`` breaks a bound."""
        worst = 0.0
        if len(self.lower_x):
            worst = max(worst, float(np.max(self.lower_y - (a * self.lower_x + b))))
        if len(self.upper_x):
            worst = max(worst, float(np.max((a * self.upper_x + b) - self.upper_y)))
        return worst


SLOPE_BINS = 6  # windows over the run, each giving one offset for the drift estimate
MIN_SLOPE_SPAN_S = 0.2  # bounds spread over less than this: offset only


def _band(s: float, lx: np.ndarray, ldev: np.ndarray, ux: np.ndarray, udev: np.ndarray
          ) -> tuple[float, float]:
    """(margin, intercept) of the line with slope ``s`` midway in the band the
    tightest bounds leave, in deviation space."""
    low = float(np.max(ldev - s * lx))
    high = float(np.min(udev - s * ux))
    return (high - low) / 2, (high + low) / 2


def _window_slope(lx: np.ndarray, ldev: np.ndarray, ux: np.ndarray, udev: np.ndarray) -> float:
    """Drift from the run's windows: each window with bounds on both sides
    gives the middle of its band; the median slope between windows (Theil-Sen).

    Not the slope that widens the band most: where tight bounds on one side
    occur only at some moments (a slow rank receives late except at the start
    of an iteration), tilting the line would widen the band and fake a drift."""
    lo, hi = float(min(lx.min(), ux.min())), float(max(lx.max(), ux.max()))
    if hi - lo < MIN_SLOPE_SPAN_S:
        return 0.0
    edges = np.linspace(lo, hi, SLOPE_BINS + 1)
    points = []
    for a, b in zip(edges[:-1], edges[1:]):
        ls, us = (lx >= a) & (lx <= b), (ux >= a) & (ux <= b)
        if ls.any() and us.any():
            points.append(((a + b) / 2, (float(np.max(ldev[ls])) + float(np.min(udev[us]))) / 2))
    if len(points) < 3:
        return 0.0
    t, mids = np.array([p[0] for p in points]), np.array([p[1] for p in points])
    slope = float(np.median([(mids[k2] - mids[k1]) / (t[k2] - t[k1])
                             for k1 in range(len(t)) for k2 in range(k1 + 1, len(t))]))
    return significant_slope(t, mids, slope)


def significant_slope(x: np.ndarray, y: np.ndarray, slope: float) -> float:
    """``slope`` if the points pin it down (3 standard errors from zero, from
    their robust scatter about the line), else 0: over a short trace a noisy
    drift estimate costs more than the drift it would correct."""
    resid = y - slope * x
    scatter = MAD_TO_SIGMA * float(np.median(np.abs(resid - np.median(resid))))
    leverage = float(np.sqrt(np.sum((x - x.mean()) ** 2)))
    if leverage <= 0 or abs(slope) > MAX_DRIFT or abs(slope) < 3 * scatter / leverage:
        return 0.0
    return slope


def maximin_line(bounds: Bounds) -> tuple[float, float, float]:
    """(a, b, margin): the drift from the run's windows, the offset midway
    between the tightest bounds on either side (margin < 0: the bounds
    contradict each other by that much, and the line splits it)."""
    x0 = float(np.median(np.concatenate([bounds.lower_x, bounds.upper_x])))
    lx, ux = bounds.lower_x - x0, bounds.upper_x - x0
    ldev, udev = bounds.lower_y - bounds.lower_x, bounds.upper_y - bounds.upper_x
    s = _window_slope(lx, ldev, ux, udev)
    margin, icpt = _band(s, lx, ldev, ux, udev)
    return 1.0 + s, icpt - s * x0, margin
