"""Run summaries computed from events in aligned (true) time.

The work is done over columns in one vectorised pass (``metrics``); these
functions accept the per-rank ``Event`` lists of small runs and foreign traces.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np

from . import metrics
from .columns import EventSource, columns_from_events, source_of
from .events import Event, RunResult
from .totals import RunTotals, fed


def iteration_spans(events: Mapping[int, Iterable[Event]]) -> dict[int, tuple[float, float]]:
    """iteration -> (first start, last end) over all ranks."""
    return metrics.iteration_spans(columns_from_events(_lists(events)))


def iteration_times(events: Mapping[int, Iterable[Event]]) -> list[float]:
    return [hi - lo for lo, hi in iteration_spans(events).values()]


def run_iteration_times(result: RunResult) -> list[float]:
    """A run's iteration times, as its summary reports them (compact runs too),
    read a few pipelines at a time."""
    times: list[float] = fed(RunTotals(), source_of(result).weighted_batches())[
        "iteration_times_s"]
    return times


def bubble_fraction(events: Mapping[int, Iterable[Event]]) -> float:
    """Mean over ranks and iterations of idle / iteration time."""
    return float(summarize(events)["bubble_fraction"])  # type: ignore[arg-type]


def summarize(events: Mapping[int, Iterable[Event]]) -> dict[str, Any]:
    cols = columns_from_events(_lists(events))
    return fed(RunTotals(), [(cols, metrics.unit_weights(cols))])


def summarize_source(source: EventSource) -> dict[str, Any]:
    """``summarize`` of a run's event source (compact for symmetric runs), a
    few whole pipelines at a time."""
    return fed(RunTotals(), source.weighted_batches())


def _lists(events: Mapping[int, Iterable[Event]]) -> dict[int, list[Event]]:
    return {r: list(ev) for r, ev in events.items()}


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total



def completed_iterations(result: RunResult) -> int:
    """Iterations whose optimizer step every rank (every one recorded) finished."""
    done: dict[int, int] = {}
    for cols in source_of(result).batches():
        code = cols.name_code("optimizer")
        ranks, steps = np.unique(cols.rank[cols.name == code], return_counts=True)
        for rank in np.unique(cols.rank).tolist():
            done.setdefault(rank, 0)
        for rank, count in zip(ranks.tolist(), steps.tolist()):
            done[rank] += count
    return min(done.values(), default=0)


def last_end_s(result: RunResult) -> float:
    return max((float(c.end_s.max()) for c in source_of(result).batches() if len(c)),
               default=0.0)


def stop_record(result: RunResult, rank: int, at_s: float) -> dict[str, Any]:
    """What the summary says of a run a crash of ``rank`` stopped at ``at_s``
    (``result``: what the run recorded until then)."""
    return {"by": "crash", "rank": rank, "at_s": at_s,
            "iterations_completed": completed_iterations(result)}
