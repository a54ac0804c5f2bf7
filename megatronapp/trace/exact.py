"""Everything about sums whose result does not depend on how the terms were
batched lives here.

A run's summary is accumulated batch by batch (a few pipelines at a time) or
from one table in memory; both must give the same bits. A float64 sum in
numpy depends on the order and grouping of its terms, so means are taken over
``ExactSum``: every term split into two integer halves of its mantissa, the
halves summed per binary exponent as integers, the total rounded once.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

_HALF = 26  # bits of the low half of a 53-bit mantissa
_BIAS = 1100  # frexp exponents of float64 lie in [-1073, 1024]
_BINS = 2 * _BIAS
_CHUNK = 1 << 25  # terms per bincount: half-mantissas (< 2**27) summed exactly in float64


class ExactSum:
    """The sum of every float64 term added, rounded once (non-finite terms
    give what float arithmetic gives them)."""

    def __init__(self) -> None:
        self._high = [0] * _BINS  # Python ints: no overflow across batches
        self._low = [0] * _BINS
        self._special = 0.0  # the sum of infinite and NaN terms

    def add(self, values: np.ndarray) -> None:
        values = np.asarray(values, np.float64).ravel()
        finite = np.isfinite(values)
        if not finite.all():
            self._special += float(values[~finite].sum())
            values = values[finite]
        for lo in range(0, len(values), _CHUNK):
            self._add_finite(values[lo:lo + _CHUNK])

    def _add_finite(self, values: np.ndarray) -> None:
        mantissa, exponent = np.frexp(values)
        whole = np.ldexp(mantissa, 53).astype(np.int64)  # exact: |value| = whole * 2**(e - 53)
        high = whole >> _HALF
        low = whole - (high << _HALF)
        at = exponent.astype(np.int64) + _BIAS
        high_sums = np.bincount(at, weights=high, minlength=_BINS)
        low_sums = np.bincount(at, weights=low, minlength=_BINS)
        for i in np.flatnonzero((high_sums != 0) | (low_sums != 0)).tolist():
            self._high[i] += int(high_sums[i])
            self._low[i] += int(low_sums[i])

    def value(self) -> float:
        if self._special != 0.0:  # an infinity or NaN among the terms (NaN != 0 too)
            return self._special
        total = Fraction(0)
        for i, (high, low) in enumerate(zip(self._high, self._low)):
            if high or low:
                total += ((high << _HALF) + low) * Fraction(2) ** (i - _BIAS - 53)
        try:
            return float(total)
        except OverflowError:  # beyond the largest float, as float arithmetic rounds it
            return math.inf if total > 0 else -math.inf


def exact_sum(values: np.ndarray) -> float:
    """``values.sum()`` rounded once, whatever their order."""
    total = ExactSum()
    total.add(values)
    return total.value()
