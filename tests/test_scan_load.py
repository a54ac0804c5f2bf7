"""Trace loading (ours and foreign Chrome traces) and analyze's busy time."""
from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatronapp.scan.analyze import analyze
from megatronapp.trace.summary import union_length
from megatronapp.scan.ingest.load import TraceError, events_from_chrome, load_trace


def _be(pid: int, name: str, start: float, end: float, **args) -> list[dict]:
    return [{"ph": "B", "name": name, "pid": pid, "tid": 7, "ts": start, "args": args},
            {"ph": "E", "name": name, "pid": pid, "tid": 7, "ts": end}]


spans = st.lists(st.tuples(st.floats(1.0, 500.0), st.floats(0.5, 300.0),
                           st.sampled_from(["ampere_sgemm_128x64", "forward", "ncclKernel_AllReduce",
                                            "SendRecv", "ProfilerStep#3"])), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.integers(0, 5), spans, min_size=1, max_size=4), st.randoms(),
       st.booleans())
def test_foreign_begin_end_trace_gives_the_direct_busy_time(per_rank, rnd, wrapped):
    """Sequential spans (gap, length, name) per rank, shuffled B/E events: compute
    busy time equals the sum of the kernel spans' lengths."""
    raw, expected = [], {}
    for pid, items in per_rank.items():
        t, busy = 0.0, 0.0
        for gap, length, name in items:
            t += gap
            raw += _be(pid, name, t, t + length)
            if name in ("ampere_sgemm_128x64", "forward"):
                busy += length * 1e-6
            t += length
        expected[pid] = busy
    rnd.shuffle(raw)  # foreign traces need not be sorted
    data = {"traceEvents": raw} if wrapped else raw
    result = analyze(events_from_chrome(data, "foreign.json"))
    for pid, busy in expected.items():
        assert result["ranks"][str(pid)]["compute_s"] == pytest.approx(busy, abs=1e-9)


def test_complete_begin_end_and_instant_events_read_the_same():
    x = [{"ph": "X", "name": "gemm_kernel", "pid": 3, "tid": 0, "ts": 10.0, "dur": 5.0, "args": {"k": 1}},
         {"ph": "i", "name": "marker", "pid": 3, "tid": 0, "ts": 12.0, "s": "t"},
         {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "rank 3"}}]
    be = _be(3, "gemm_kernel", 10.0, 15.0, k=1) + [x[1]]
    for events in (events_from_chrome(x), events_from_chrome({"traceEvents": be[::-1][1:] + be[-1:]})):
        names = [(e.name, e.dur_s) for e in events[3]]
        assert ("gemm_kernel", pytest.approx(5e-6)) in names and ("marker", 0.0) in names


@pytest.mark.parametrize("raw, fragment", [
    ([{"ph": "X", "name": "k", "pid": 0, "ts": "soon", "dur": 1}], "event 0: 'ts' must be a number"),
    ([{"ph": "X", "name": "k", "pid": 0, "ts": 1, "dur": 1}, {"ph": "E", "pid": 0, "ts": 2}],
     "event 1: 'E' event None has no open 'B'"),
    (_be(0, "k", 1, 2)[:1], "event 0: 'B' event 'k'"),
    (_be(0, "k", 5, 2), "has no open 'B'"),
    (_be(0, "k", 1, 2) + _be(0, "j", 1, 2)[1:], "'E' event 'j' has no open 'B'"),
    ([{"ph": "X", "name": "k", "pid": "gpu0", "ts": 1, "dur": 1}], "'pid' must be an integer rank"),
    # the columns hold ranks and indices in 32 bits: a larger one is an error, not an overflow
    ([{"ph": "X", "name": "k", "pid": 10 ** 30, "ts": 1, "dur": 1}], "'pid' must be an integer rank"),
    ([{"ph": "X", "name": "k", "pid": "-9999999999", "ts": 1, "dur": 1}], "(32-bit)"),
    ([{"ph": "X", "name": "k", "pid": 0, "ts": 1, "dur": 1, "args": {"iteration": 2 ** 31}}],
     "args.iteration must be a 32-bit integer"),
    ([{"ph": "X", "name": "k", "pid": 0, "ts": 1, "dur": 1, "args": {"group": [0, 2 ** 40]}}],
     "args.group must be a list of 32-bit integer ranks"),
    ([{"ph": "X", "name": "k", "pid": 0, "ts": 1, "dur": 1, "args": {"bytes": 10 ** 30}}],
     "args.bytes must be a finite number in [0, 2**63)"),
    ([{"ph": "X", "name": "k", "pid": 0, "ts": 1, "dur": -3}], "negative duration"),
    ({"events": []}, "expected a list of events"),
])
def test_malformed_input_names_the_file_and_the_event(raw, fragment):
    with pytest.raises(TraceError) as err:
        events_from_chrome(raw, "job.json")
    assert str(err.value).startswith("job.json") and fragment in str(err.value)


def test_unreadable_files_name_the_file(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text("{not json")
    with pytest.raises(TraceError, match="t.json: not valid JSON"):
        load_trace(bad)
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "missing.json")


def test_union_length_counts_overlaps_once():
    assert union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
    assert union_length([]) == 0.0


def test_analyze_splits_each_rank_microsecond_by_microsecond(tmp_path):
    """Random overlapping ops on whole microseconds: each microsecond of the
    window is compute if a compute covers it, else communication if a send or
    an all-reduce does, else idle; analyze's unions agree with that count."""
    rng = random.Random(4)
    raw = []
    for pid in range(3):
        for _ in range(20):
            raw.append({"ph": "X", "name": rng.choice(["forward", "send_forward", "dp_allreduce"]),
                        "pid": pid, "ts": rng.randrange(0, 1000), "dur": rng.randrange(1, 50)})
    path = tmp_path / "t.json"
    path.write_text(json.dumps(raw))
    result = analyze(load_trace(path).events)
    lo, hi = min(e["ts"] for e in raw), max(e["ts"] + e["dur"] for e in raw)
    for pid in range(3):
        mine = [e for e in raw if e["pid"] == pid]

        def covered(t: int, names: tuple[str, ...]) -> bool:
            return any(e["name"] in names and e["ts"] <= t < e["ts"] + e["dur"] for e in mine)

        compute = [t for t in range(lo, hi) if covered(t, ("forward",))]
        comm = [t for t in range(lo, hi) if t not in compute
                and covered(t, ("send_forward", "dp_allreduce"))]
        got = result["ranks"][str(pid)]
        assert got["compute_s"] == pytest.approx(len(compute) * 1e-6)
        assert got["comm_s"] == pytest.approx(len(comm) * 1e-6)
        assert got["idle_s"] == pytest.approx((hi - lo - len(compute) - len(comm)) * 1e-6)
