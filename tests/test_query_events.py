"""The ``events`` view of ``query`` is built from columns, with no object per
event; row for row it says what the per-event path says (``deps.annotate``
over the aligned events): names, kinds, times, group text, the sync op's id
and the args."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from megatronapp.scan.align.inputs import load_scan_input
from megatronapp.scan.ingest.deps import annotate
from megatronapp.scan.query import sandboxed, scan_loader
from megatronapp.trace.kinds import event_kind

from .support import ROOT

ORDER = "ORDER BY rank, start_us, dur_us DESC, name, args"
COLUMNS = ("rank", "name", "kind", "start_us", "dur_us", "end_us", "iteration", "microbatch",
           "chunk", "bytes", "peer", "group_ranks", "related_sync_op", "args")


def reference_rows(target: Path) -> list[tuple[Any, ...]]:
    """The table as the per-event path builds it: each aligned event, its op linked."""
    scan = load_scan_input(target)
    events = annotate(scan.events, list(scan.ops))
    rows = []
    for rank in sorted(events):
        for e in events[rank]:
            a, group = e.args, e.args.get("group")
            rows.append((rank, e.name, event_kind(e.name, a), e.start_s * 1e6, e.dur_s * 1e6,
                         e.end_s * 1e6, a.get("iteration"), a.get("microbatch"), a.get("chunk"),
                         None if a.get("bytes") is None else float(a["bytes"]), a.get("peer"),
                         ",".join(map(str, group)) if isinstance(group, list) else None,
                         a.get("related_sync_op"), {k: v for k, v in a.items() if v is not None}))
    return sorted(rows, key=lambda r: (r[0], r[3], -r[4], r[1], json.dumps(r[-1], sort_keys=True)))


def view_rows(target: Path) -> list[tuple[Any, ...]]:
    with sandboxed(scan_loader(load_scan_input(target))) as con:
        rows = con.execute(f"SELECT {', '.join(COLUMNS)} FROM events").fetchall()
    rows = [(*r[:-1], json.loads(r[-1])) for r in rows]
    return sorted(rows, key=lambda r: (r[0], r[3], -r[4], r[1], json.dumps(r[-1], sort_keys=True)))


def _untagged_trace(path: Path) -> Path:
    """A Chrome trace of two ranks whose sends and receives carry no role or tag
    (their direction is in the name), a collective, and args of every shape."""
    events = []
    for rank in (0, 1):
        t = 0.0
        for mb in range(3):
            events.append({"ph": "X", "pid": rank, "name": "forward", "ts": t, "dur": 10,
                           "args": {"iteration": 0, "microbatch": mb, "note": "é€", "x": None}})
            t += 10
            side = "send_forward" if rank == 0 else "recv_forward"
            events.append({"ph": "X", "pid": rank, "name": side, "ts": t, "dur": 2,
                           "args": {"peer": 1 - rank, "iteration": 0, "microbatch": mb,
                                    "bytes": 1.5 if mb == 1 else 64}})
            t += 2
        events.append({"ph": "X", "pid": rank, "name": "allreduce", "ts": t, "dur": 5,
                       "args": {"group": [1, 0], "bytes": 128, "nested": {"a": [1, 2]}}})
    path.write_text(json.dumps({"traceEvents": events}))
    return path


@pytest.fixture
def stored_run(throttle_run: Path) -> Path:
    return throttle_run


def test_a_stored_run_with_skewed_clocks(stored_run: Path) -> None:
    assert view_rows(stored_run) == reference_rows(stored_run)


def test_its_merged_json_trace(stored_run: Path) -> None:
    target = stored_run / "trace.json"
    assert view_rows(target) == reference_rows(target)


def test_a_trace_with_untagged_point_to_point_and_odd_args(tmp_path: Path) -> None:
    target = _untagged_trace(tmp_path / "t.json")
    rows = view_rows(target)
    assert rows == reference_rows(target)
    linked = {r[12] for r in rows if r[12] is not None}
    assert "p2p[0->1:forward]#2" in linked and "coll[0,1]#0" in linked


@pytest.mark.parametrize("target", ["tests/data/gpu_kineto/megatron_run/profile",
                                    "tests/data/gpu_kineto/nccl_loop"])
def test_a_torch_profiler_directory(target: str) -> None:
    assert view_rows(ROOT / target) == reference_rows(ROOT / target)
