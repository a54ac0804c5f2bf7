"""Each rank's time in an op summed per whole iteration
(``megatronapp.scan.evidence.iteration_totals``): the same totals however the
trace is cut into time-ordered batches, the last (maybe partial) iteration
left out, a late row of a closed iteration never counted as one of its own."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from megatronapp.scan.evidence.iteration_totals import IterationTotals
from megatronapp.trace.columns import EventColumns, columns_from_events
from megatronapp.trace.events import Event

RANKS, OPS = 3, ("aten::mm", "aten::add")
COMPUTE = {"kind": "compute"}


def trace(durations: np.ndarray) -> EventColumns:
    """``durations[rank, iteration, call]`` µs: the calls of each iteration
    run back to back, alternating the two ops; rows in time order."""
    events: dict[int, list[Event]] = {}
    for rank in range(durations.shape[0]):
        at, mine = 0.0, []
        for it in range(durations.shape[1]):
            for call, us in enumerate(durations[rank, it]):
                mine.append(Event(OPS[call % 2], at, us * 1e-6, COMPUTE | {"iteration": it}))
                at += us * 1e-6
        events[rank] = mine
    cols = columns_from_events(events)
    return cols.take(np.argsort(cols.start_s, kind="stable"))


def expected(durations: np.ndarray, iterations: int) -> dict[int, dict[str, list[float]]]:
    """Per rank and op, the summed µs of each of the first ``iterations``."""
    return {r: {op: [float(np.sum(durations[r, it, k::2])) for it in range(iterations)]
                for k, op in enumerate(OPS)} for r in range(durations.shape[0])}


def in_us(totals: dict[int, dict[str, np.ndarray]]) -> dict[int, dict[str, list[float]]]:
    return {r: {op: [round(float(v) * 1e6, 6) for v in values] for op, values in ops.items()}
            for r, ops in totals.items()}


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), st.integers(2, 5), st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_the_totals_are_the_same_however_the_trace_is_cut_in_time_order(
        iterations, calls, batches, seed):
    rng = np.random.default_rng(seed)
    durations = np.round(rng.uniform(1.0, 100.0, (RANKS, iterations, calls)), 3)
    cols = trace(durations)
    totals = IterationTotals()
    cuts = np.sort(rng.integers(0, len(cols) + 1, batches - 1))
    for part in np.split(np.arange(len(cols)), cuts):
        totals.feed(cols.take(part))
    # the last iteration may be partial: left out
    want = expected(durations, iterations - 1)
    assert in_us(totals.totals()) == {r: {op: [round(v, 6) for v in vs] for op, vs in ops.items()}
                                      for r, ops in want.items()}


def test_a_row_of_an_iteration_already_closed_is_not_counted_as_one_of_its_own():
    durations = np.full((RANKS, 4, 2), 10.0)
    cols = trace(durations)
    totals = IterationTotals()
    totals.feed(cols)
    # iteration 1 of rank 0 comes again, after iteration 3 was fed
    late = columns_from_events({0: [Event("aten::mm", 1.0, 5e-6, COMPUTE | {"iteration": 1})]})
    totals.feed(late)
    assert len(totals.totals()[0]["aten::mm"]) == 3


def test_a_rank_behind_the_others_keeps_its_iterations_that_they_have_passed():
    # rank 2 has fed only iterations 0-1 while the others reached 3: its
    # iteration 1 is whole (the others went past it), their 3 is not
    durations = np.full((RANKS, 4, 2), 10.0)
    cols = trace(durations)
    behind = (cols.rank != 2) | (cols.iteration < 2)
    totals = IterationTotals()
    totals.feed(cols.take(behind))
    got = totals.totals()
    assert [len(got[r]["aten::mm"]) for r in range(RANKS)] == [3, 3, 2]


def test_rows_without_an_iteration_give_no_totals():
    events = {r: [Event("aten::mm", 0.0, 1e-3, COMPUTE)] for r in (0, 1)}
    totals = IterationTotals()
    totals.feed(columns_from_events(events))
    assert totals.totals() == {} and totals.entries() == 0
