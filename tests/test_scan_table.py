"""Sync ops and clock bounds over columns (``scan.table``) against the
per-event linking (``deps``) and causal bounds (``align``), and the
detector's vectorised statistics against their definitions."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from megatronapp.trace.columns import columns_from_events
from megatronapp.scan.align.align import ClockFit, causal_bounds
from megatronapp.scan.ingest.deps import reconstruct
from megatronapp.scan.evidence.detect import megascan
from megatronapp.scan.ingest.load import events_from_chrome
from megatronapp.scan.align.table import causal_violations, sorted_like_loader, sync_table
from megatronapp.scan.eval.trials import make_sim_trial
from megatronapp.scan.eval.validate import scan_of_result
from megatronapp.trace.events import chrome_events
from sim import run_sim

from .support import real_like, real_like_run



def _raw_events(result: Any) -> dict[int, list[Any]]:
    raw = [ev for r in sorted(result.events) for ev in chrome_events(
        r, result.label(r), result.events[r], result.clocks[r].local)]
    return events_from_chrome(raw, "trial")


# Real-like timing (completions do not coincide: every clock is solved from
# causal bounds and pairwise estimates): a slow link on a pipeline, a
# throttle among contended data-parallel ranks, contention alone.
REAL_LIKE = {
    "slow link": (dict(tp=1, pp=4, dp=1), (), dict(seed=6, link=((1, 2), "slow", 4e-3))),
    "throttle": (dict(tp=1, pp=2, dp=2), ({"kind": "throttle", "rank": 1, "factor": 1.6},),
                 dict(seed=3, contended={2: 0.7, 0: 0.3})),
    "contention": (dict(tp=1, pp=2, dp=2), (), dict(seed=5, contended={2: 0.8, 1: 0.2})),
}


# what each real-like case injected: a pair's slow link, a throttled rank, nothing
INJECTED = {"slow link": (1, "link", 2), "throttle": (1, "compute", None), "contention": None}


@pytest.mark.parametrize("case", sorted(REAL_LIKE))
def test_real_like_timing_is_aligned_by_causal_bounds_and_its_fault_named(case: str) -> None:
    shape, faults, distort = REAL_LIKE[case]
    scan = scan_of_result(real_like(real_like_run(**shape, iterations=6, faults=faults), **distort))
    assert {f.method for r, f in scan.clocks.items() if r != 0} == {"bounds"}
    named = [(c.rank, c.kind, c.peer) for c in megascan(scan).root_causes]
    assert INJECTED[case] in named if INJECTED[case] else named == []


@pytest.mark.parametrize("case", sorted(REAL_LIKE))
def test_causal_violations_match_the_per_event_bounds(case: str) -> None:
    """Every rank's worst broken causal bound, under clock lines that break
    some (each rank's fit shifted by its own amount), as ``align`` finds it."""
    shape, faults, distort = REAL_LIKE[case]
    raw = _raw_events(real_like(real_like_run(**shape, iterations=6, faults=faults), **distort))
    cols = sorted_like_loader(columns_from_events(raw))
    sync = sync_table(cols)
    ranks = np.unique(cols.rank).astype(np.int64)
    fits = {int(r): ClockFit(1.0 + 1e-5 * k, 1e-3 * (k % 3)) for k, r in enumerate(ranks)}
    got = causal_violations(cols, sync, ranks, np.array([fits[int(r)].a for r in ranks]),
                            np.array([fits[int(r)].b for r in ranks]))
    ops = [op for op in reconstruct(raw) if len(op.members) > 1]
    expected = [causal_bounds(int(r), [op for op in ops if int(r) in op.ranks], raw, fits)
                .violation(fits[int(r)].a, fits[int(r)].b) for r in ranks]
    assert max(expected) > 0  # some bounds are broken
    assert got.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_sync_ops_link_the_same_events() -> None:
    events = _raw_events(run_sim(make_sim_trial(0, 8).scenario))
    cols = sorted_like_loader(columns_from_events(events))
    sync = sync_table(cols)
    start = {r: i for r, i in zip(*_first_rows(cols))}
    got = set()
    for op in range(sync.ops):
        rows = sync.members(op).tolist()
        got.add(tuple((int(cols.rank[x]), x - start[int(cols.rank[x])]) for x in rows))
    expected = {tuple(op.members) for op in reconstruct(events)}
    assert got == expected


def _first_rows(cols: Any) -> tuple[list[int], list[int]]:
    bounds = cols.rank_bounds()
    return list(bounds), [lo for lo, _hi in bounds.values()]
