"""The columnar MegaScan (``scan.table``) against the per-event one, on the
detector-validation trials: same sync ops, same clock fits, same diagnosis."""
from __future__ import annotations

from typing import Any

import pytest

from backends.sim import run_sim
from megatronapp.columns import columns_from_events
from megatronapp.scan.deps import reconstruct
from megatronapp.scan.detect import megascan
from megatronapp.scan.load import events_from_chrome
from megatronapp.scan.table import prepare_table, sorted_like_loader, sync_table
from megatronapp.scan.table_detect import megascan_table
from megatronapp.scan.trials import make_sim_trial
from megatronapp.scan.validate import scan_of_result
from megatronapp.tracer import chrome_events

# One trial of each band: skew only, slow link, healthy, jittered link, three throttles.
TRIALS = (0, 1, 2, 5, 8, 9, 11)


def _raw_events(result: Any) -> dict[int, list[Any]]:
    raw = [ev for r in sorted(result.events) for ev in chrome_events(
        r, result.label(r), result.events[r], result.clocks[r].local)]
    return events_from_chrome(raw, "trial")


@pytest.mark.parametrize("index", TRIALS)
def test_columnar_scan_diagnoses_like_the_per_event_scan(index: int) -> None:
    result = run_sim(make_sim_trial(0, index).scenario)
    per_event = scan_of_result(result)
    table = prepare_table(columns_from_events(_raw_events(result)), aligned=False, ref=0)
    for rank, fit in per_event.clocks.items():
        assert table.clocks[rank].a == pytest.approx(fit.a, rel=1e-12, abs=1e-12)
        assert table.clocks[rank].b == pytest.approx(fit.b, rel=1e-9, abs=1e-12)
        assert table.clocks[rank].anchors == fit.anchors
    expected, got = megascan(per_event), megascan_table(table)
    assert [(c.rank, c.kind, c.peer) for c in got.root_causes] == \
        [(c.rank, c.kind, c.peer) for c in expected.root_causes]
    for a, b in zip(got.root_causes, expected.root_causes):
        assert a.confidence == pytest.approx(b.confidence, rel=1e-9)
        assert a.evidence == b.evidence
    assert got.victims == expected.victims


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
