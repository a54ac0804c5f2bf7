"""trace.parquet, exports of selections (Chrome and Perfetto) and old run directories."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sim import run_sim
from megatronapp.cli import main
from megatronapp.trace.columns import (TableSource, columns_from_events, event_args,
                                       whole_ranks)
from megatronapp.scenario.config import load_scenario, parse_scenario
from megatronapp.trace.store import (StoreMeta, local_clock_view, read_columns, read_meta,
                                    write_events)
from megatronapp.trace.kinds import event_kind
from megatronapp.io.outdirs import read_manifest
from megatronapp.scan.ingest.load import read_events
from megatronapp.scan.ingest.load import load_trace
from megatronapp.trace.events import Event, RankClock, chrome_events, write_json

from .support import ROOT, run_cli


def _flat(events: Any) -> list[tuple[Any, ...]]:
    return sorted((r, e.name, e.start_s, e.dur_s, tuple(sorted((k, str(v)) for k, v in
                                                               e.args.items())))
                  for r in events for e in events[r])


SMALL = {"seed": 3, "iterations": 2, "schedule": "interleaved",
         "parallel": {"tp": 2, "pp": 2, "dp": 2, "vpp": 2, "microbatches": 4},
         "model": {"layers": 8, "hidden": 256, "heads": 4, "seq_len": 128, "vocab": 1024},
         "cluster": {"jitter": {"compute_sigma": 0.05, "link_sigma": 0.1}},
         "faults": [{"kind": "clock_skew", "rank": 3, "offset_us": 250.0, "drift_ppm": 40.0}]}


def test_parquet_round_trip_keeps_every_event_and_argument(tmp_path: Path) -> None:
    result = run_sim(parse_scenario(SMALL))
    odd = {**result.events, 99: [Event("annotation", 0.5, 0.25, {"note": "x", "iteration": 1,
                                                                  "peer": "n/a"})]}
    cols = columns_from_events(odd)
    clocks = {3: RankClock(250.0, 40.0)}
    rows = write_events(tmp_path / "t.parquet", TableSource(cols),
                        StoreMeta(9, cols.groups, clocks), max_rows=100)
    assert rows == len(cols)
    back, meta = read_columns(tmp_path / "t.parquet")
    assert meta.clocks == clocks and meta.groups == cols.groups
    view = load_trace(tmp_path / "t.parquet").events
    # an event without a recorded kind reads back with the one classifier's kind
    classified = [Event(e.name, e.start_s, e.dur_s, {**e.args, "kind": event_kind(e.name, e.args)})
                  for e in odd[99]]
    assert classified[0].args["kind"] == "p2p"  # a peer argument marks point-to-point
    assert _flat(view) == _flat({**odd, 99: classified})
    local = local_clock_view(back, meta.clocks)
    skewed = local.rank == 3
    assert np.allclose(local.start_s[skewed], back.start_s[skewed] * (1 + 40e-6) + 250e-6)
    assert (local.start_s[~skewed] == back.start_s[~skewed]).all()


def test_an_integer_arg_its_column_cannot_hold_is_kept_as_it_was() -> None:
    # bytes and tags are 64-bit columns, peers 32-bit: a larger value stays an arg
    args = {"bytes": 2 ** 70, "tag": 2 ** 64, "peer": 2 ** 40, "iteration": 3}
    cols = columns_from_events({0: [Event("send", 0.0, 1.0, args)]})
    assert (cols.nbytes[0], cols.tag[0], cols.peer[0], cols.iteration[0]) == (-1, -1, -1, 3)
    assert event_args(cols, 0) == {**args, "kind": event_kind("send", args)}


def test_batches_recut_never_split_a_rank() -> None:
    cols = columns_from_events(run_sim(parse_scenario(SMALL)).events)
    pieces = list(whole_ranks(TableSource(cols).batches(37)))
    assert sum(len(p) for p in pieces) == len(cols)
    seen: set[int] = set()
    for p in pieces:
        ranks = set(np.unique(p.rank).tolist())
        assert not ranks & seen
        seen |= ranks


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("small") / "run"
    assert main(["run", str(ROOT / "scenarios" / "throttle.yaml"), "--out", str(out),
                 "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def big_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1024-GPU job: too many events for a browser, so no trace.json."""
    out = tmp_path_factory.mktemp("big") / "run"
    proc = run_cli("run", str(ROOT / "scenarios" / "scan_1024.yaml"), "--out", str(out),
                   "--set", "cluster.jitter.compute_sigma=0", "--set",
                   "cluster.jitter.link_sigma=0", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "no trace.json" in proc.stdout and "export-trace" in proc.stdout
    return out


@pytest.mark.slow
def test_a_big_run_writes_only_the_table_and_exports_a_selection(big_run: Path) -> None:
    assert (big_run / "trace.parquet").is_file() and not (big_run / "trace.json").exists()
    summary = json.loads((big_run / "summary.json").read_text())
    assert summary["trace"]["events"] > 200_000 and not summary["trace"]["trace_json"]
    out = big_run / "sel.json"
    proc = run_cli("export-trace", str(big_run), "--ranks", "0-7,517", "--iterations", "0",
                   "--clock", "local", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    exported = read_events(out)
    cols, meta = read_columns(big_run / "trace.parquet", ranks=[0, 517])
    local = local_clock_view(cols, meta.clocks)
    assert sorted(exported) == [*range(8), 517]
    mine = local.start_s[local.rank == 517]
    assert sorted(e.start_s for e in exported[517]) == pytest.approx(sorted(mine), abs=2e-9)
    labels = {e["pid"]: e["args"]["name"] for e in json.loads(out.read_text())["traceEvents"]
              if e.get("name") == "process_name"}
    assert labels[517] == "rank 517 (dp 0, pp 4, tp 5)"


@pytest.mark.parametrize("args,field", [(["--ranks", "3-1"], "--ranks"),
                                        (["--ranks", "x"], "--ranks"),
                                        (["--ranks", "16"], "--ranks"),
                                        (["--iterations", "-2"], "--iterations")])
def test_a_bad_selection_is_one_line(small_run: Path, capsys: Any, args: list[str],
                                     field: str) -> None:
    assert main(["export-trace", str(small_run), *args]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and field in err
    assert not list(small_run.glob("trace-*")) and not list(small_run.glob(".*partial*"))


def test_an_export_carries_what_the_backend_recorded_and_joins_the_run(small_run: Path) -> None:
    assert main(["export-trace", str(small_run), "--ranks", "4", "--iterations", "1"]) == 0
    path = small_run / "trace-ranks4_it1.json"
    simulated = [e for e in run_sim(load_scenario(ROOT / "scenarios" / "throttle.yaml")).events[4]
                 if e.args.get("iteration") == 1]
    exported = read_events(path)[4]
    assert {e.args["kind"] for e in simulated} == {"compute", "p2p", "collective"}
    assert sorted((e.name, json.dumps(dict(e.args), sort_keys=True)) for e in exported) == \
        sorted((e.name, json.dumps(dict(e.args), sort_keys=True)) for e in simulated)
    assert sorted(e.start_s for e in exported) == pytest.approx(
        sorted(e.start_s for e in simulated), abs=2e-9)
    manifest = read_manifest(small_run)
    assert manifest is not None and path.name in manifest.added  # --force replaces it too


def _perfetto_classes() -> Any:
    """Perfetto's trace messages (the fields we write), built from descriptors so
    that protobuf itself parses the file."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    f = descriptor_pb2.FileDescriptorProto(name="perfetto_subset.proto", package="p",
                                           syntax="proto2")
    T = descriptor_pb2.FieldDescriptorProto

    def msg(name: str, *fields: tuple[str, int, int, str | None, int]) -> None:
        m = f.message_type.add(name=name)
        for fname, number, ftype, type_name, label in fields:
            fd = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                fd.type_name = f".p.{type_name}"

    opt, rep = T.LABEL_OPTIONAL, T.LABEL_REPEATED
    msg("DebugAnnotation", ("name", 10, T.TYPE_STRING, None, opt),
        ("int_value", 4, T.TYPE_INT64, None, opt), ("string_value", 6, T.TYPE_STRING, None, opt))
    msg("TrackEvent", ("type", 9, T.TYPE_INT32, None, opt),
        ("track_uuid", 11, T.TYPE_UINT64, None, opt), ("name", 23, T.TYPE_STRING, None, opt),
        ("debug_annotations", 4, T.TYPE_MESSAGE, "DebugAnnotation", rep))
    msg("ProcessDescriptor", ("pid", 1, T.TYPE_INT32, None, opt),
        ("process_name", 6, T.TYPE_STRING, None, opt))
    msg("ThreadDescriptor", ("pid", 1, T.TYPE_INT32, None, opt),
        ("tid", 2, T.TYPE_INT64, None, opt), ("thread_name", 5, T.TYPE_STRING, None, opt))
    msg("TrackDescriptor", ("uuid", 1, T.TYPE_UINT64, None, opt),
        ("parent_uuid", 5, T.TYPE_UINT64, None, opt),
        ("process", 3, T.TYPE_MESSAGE, "ProcessDescriptor", opt),
        ("thread", 4, T.TYPE_MESSAGE, "ThreadDescriptor", opt))
    msg("TracePacket", ("timestamp", 8, T.TYPE_UINT64, None, opt),
        ("trusted_packet_sequence_id", 10, T.TYPE_UINT32, None, opt),
        ("track_event", 11, T.TYPE_MESSAGE, "TrackEvent", opt),
        ("track_descriptor", 60, T.TYPE_MESSAGE, "TrackDescriptor", opt))
    msg("Trace", ("packet", 1, T.TYPE_MESSAGE, "TracePacket", rep))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("p.Trace"))


def test_perfetto_export_is_a_valid_trace_with_nested_slices(small_run: Path) -> None:
    out = small_run
    path = out / "p.pftrace"
    assert main(["export-trace", str(out), "--ranks", "4-5", "--format", "perfetto",
                 "--out", str(path)]) == 0
    trace = _perfetto_classes()()
    trace.ParseFromString(path.read_bytes())
    tracks = {p.track_descriptor.uuid: p.track_descriptor for p in trace.packet
              if p.HasField("track_descriptor")}
    names = {t.process.pid: t.process.process_name for t in tracks.values() if t.HasField("process")}
    assert names == {4: "rank 4 (dp 0, pp 1, tp 0)", 5: "rank 5 (dp 0, pp 1, tp 1)"}
    stacks: dict[int, list[tuple[str, int]]] = {}
    last_ts: dict[int, int] = {}
    begun = []
    for p in trace.packet:
        if not p.HasField("track_event"):
            continue
        e = p.track_event
        assert e.track_uuid in tracks and p.timestamp >= last_ts.get(p.trusted_packet_sequence_id, 0)
        last_ts[p.trusted_packet_sequence_id] = p.timestamp
        stack = stacks.setdefault(e.track_uuid, [])
        if e.type == 1:
            assert not stack, "slices on one track never overlap"
            stack.append((e.name, p.timestamp))
            begun.append((tracks[e.track_uuid].thread.pid, e.name, p.timestamp))
        else:
            name, start = stack.pop()
            assert e.type == 2 and p.timestamp >= start
    assert all(not s for s in stacks.values())
    cols, _meta = read_columns(out / "trace.parquet", ranks=[4, 5])
    assert len(begun) == len(cols)
    assert sorted((r, n) for r, n, _ in begun) == sorted(
        (int(r), cols.names[c]) for r, c in zip(cols.rank, cols.name))


def test_an_old_run_directory_still_loads(tmp_path: Path) -> None:
    """Run directories written before trace.parquet: ranks/*.json in local clocks."""
    result = run_sim(parse_scenario(SMALL))
    old = tmp_path / "old"
    (old / "ranks").mkdir(parents=True)
    merged = []
    for rank, events in result.events.items():
        clock = result.clocks[rank]
        write_json(old / "ranks" / f"rank{rank}.json",
                   {"traceEvents": chrome_events(rank, result.label(rank), list(events), clock.local),
                    "metadata": {"rank": rank, "clock": "local"}})
        merged += chrome_events(rank, result.label(rank), list(events), lambda t: t)
    write_json(old / "trace.json", {"traceEvents": merged, "metadata": {"clock": "aligned"}})
    raw = load_trace(old)
    assert not raw.aligned and raw.events[3][0].start_s == pytest.approx(
        result.events[3][0].start_s * (1 + 40e-6) + 250e-6, abs=1e-9)
    assert main(["detect", str(old), "--json"]) == 0
    assert main(["export-trace", str(old)]) == 2


def test_store_metadata_names_a_foreign_parquet_file(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "foreign.parquet")
    with pytest.raises(ValueError, match="not a megatronapp event table"):
        read_meta(tmp_path / "foreign.parquet")
    assert main(["detect", str(tmp_path / "foreign.parquet")]) == 2


def test_read_events_takes_a_string_path_as_the_docs_show(tmp_path: Path) -> None:
    from megatronapp.scan.ingest.load import read_events

    out = tmp_path / "res"
    assert run_cli("run", str(ROOT / "scenarios" / "throttle.yaml"), "--out",
                   str(out)).returncode == 0
    events = read_events(str(out / "trace.json"))
    assert sorted(events) == list(range(16)) and all(events[r] for r in events)
