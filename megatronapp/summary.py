"""Run summaries computed from events in aligned (true) time."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Mapping

from .kinds import event_kind
from .tracer import Event


def iteration_spans(events: Mapping[int, Iterable[Event]]) -> dict[int, tuple[float, float]]:
    """iteration -> (first start, last end) over all ranks."""
    spans: dict[int, tuple[float, float]] = {}
    for rank_events in events.values():
        for e in rank_events:
            it = e.args.get("iteration")
            if it is None:
                continue
            lo, hi = spans.get(it, (e.start_s, e.end_s))
            spans[it] = (min(lo, e.start_s), max(hi, e.end_s))
    return dict(sorted(spans.items()))


def iteration_times(events: Mapping[int, Iterable[Event]]) -> list[float]:
    return [hi - lo for lo, hi in iteration_spans(events).values()]


def compute_busy(events: Iterable[Event]) -> dict[int, float]:
    """iteration -> seconds of compute (forward/backward/optimizer) on one rank."""
    busy: dict[int, float] = defaultdict(float)
    for e in events:
        if "iteration" in e.args and event_kind(e.name, e.args) == "compute":
            busy[e.args["iteration"]] += e.dur_s
    return busy


def bubble_fraction(events: Mapping[int, Iterable[Event]]) -> float:
    """Mean over ranks and iterations of idle / iteration time."""
    spans = iteration_spans(events)
    fractions = []
    for rank_events in events.values():
        busy = compute_busy(rank_events)
        for it, (lo, hi) in spans.items():
            if hi > lo:
                fractions.append(1.0 - busy.get(it, 0.0) / (hi - lo))
    return sum(fractions) / len(fractions) if fractions else 0.0


def summarize(events: Mapping[int, Iterable[Event]]) -> dict[str, Any]:
    events = {r: list(ev) for r, ev in events.items()}
    return {"iteration_times_s": iteration_times(events),
            "bubble_fraction": bubble_fraction(events)}


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total

