"""Everything about a run's summary accumulated batch by batch lives here.

A job where nothing reduces holds tens of millions of events; its summary is
taken a few whole pipelines at a time (``EventSource.weighted_batches``) and
what is kept between batches is per iteration and per rank, never per event.
Fed one table, or the same rows in any cut into batches of whole ranks, a
``RunTotals`` gives the same bits: minima, maxima and per-rank sums do not
depend on other ranks' rows, and every mean is of exact sums (``exact``).
"""
from __future__ import annotations

from typing import Any, Iterable, Protocol

import numpy as np

from . import metrics
from .columns import EventColumns
from .exact import ExactSum

Weighted = tuple[EventColumns, np.ndarray]  # rows and how many ranks each stands for


class BatchTotals(Protocol):
    """A summary section accumulated batch by batch (each batch whole pipelines)."""

    def add(self, cols: EventColumns, weight: np.ndarray) -> None: ...
    def finish(self) -> dict[str, Any]: ...


class WeightedMean:
    """A weighted mean over batches, its sums exact."""

    def __init__(self) -> None:
        self._num, self._den = ExactSum(), ExactSum()

    def add(self, values: np.ndarray, weight: np.ndarray) -> None:
        self._num.add(values * weight)
        self._den.add(weight)

    def value(self) -> float:
        total = self._den.value()
        return self._num.value() / total if total > 0 else 0.0


class RunTotals:
    """Iteration spans (first start, last end over every rank) and each rank's
    compute busy time per iteration; a rank's rows must come in one batch."""

    def __init__(self) -> None:
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._busy: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []

    def add(self, cols: EventColumns, weight: np.ndarray) -> None:
        if not len(cols):
            return
        for it, (lo, hi) in metrics.iteration_spans(cols).items():
            self._first[it] = min(lo, self._first.get(it, lo))
            self._last[it] = max(hi, self._last.get(it, hi))
        self._busy.append(metrics.busy_times(cols, weight))

    def spans(self) -> dict[int, tuple[float, float]]:
        """iteration -> (first start, last end), iterations ascending."""
        return {it: (self._first[it], self._last[it]) for it in sorted(self._first)}

    def bubble_fraction(self) -> float:
        """Mean idle share of ranks x iterations (a rank without compute in an
        iteration idles through it)."""
        spans = self.spans()
        if not spans or not self._busy:
            return 0.0
        its = np.array(list(spans), np.int64)
        width = np.array([hi - lo for lo, hi in spans.values()])
        keep = width > 0
        mean = WeightedMean()
        for _ranks, rank_weight, batch_its, busy in self._busy:
            full = np.zeros((len(rank_weight), len(its)))
            full[:, np.searchsorted(its, batch_its)] = busy
            fractions = full[:, keep] / width[keep]
            mean.add(fractions.ravel(), np.repeat(rank_weight, int(keep.sum())))
        return 1.0 - mean.value() if keep.any() else 0.0

    def finish(self) -> dict[str, Any]:
        """Iteration times and the bubble fraction."""
        return {"iteration_times_s": [hi - lo for lo, hi in self.spans().values()],
                "bubble_fraction": self.bubble_fraction()}


def fed(totals: BatchTotals, batches: Iterable[Weighted]) -> dict[str, Any]:
    """``totals`` fed every batch, finished."""
    for cols, weight in batches:
        totals.add(cols, weight)
    return totals.finish()
