"""Capture storage: per-rank parts merge into one capture (TP slices combined
exactly), readable without torch, queryable with DuckDB and nothing else; the
writer's queue drops the oldest batch and counts it."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from backends.torch.scope_writer import AsyncWriter, DeviceBatch, DeviceRecord
from megatronapp.errors import UserError
from megatronapp.scope.stats import Slice, finish, partials
from megatronapp.scope.storage import (Capture, HostRecord, PartWriter, RawSlice, RecordKey, Rows,
                                       merge_capture)
from megatronapp.scope.summary import query, summary_lines
from megatronapp.scenario.scope_spec import parse_stat
from tests.support import ROOT, run_cli

STATS = ("mean", "std", "kurtosis", "topk(3)", "pixels_absmax(4)", "hist")


def rows_of(n: int) -> Rows:
    return Rows(np.zeros(n, int), np.full(n, -1), np.arange(n))


def record(x: np.ndarray, key: RecordKey, offset: int, full: int, shard: int,
           nshards: int) -> HostRecord:
    specs = tuple(parse_stat(s) for s in STATS)
    part = partials(torch.from_numpy(x), specs, Slice(offset, full)).numpy()
    from megatronapp.scope.stats import widths
    return HostRecord(key, rows_of(len(x)), tuple(s.label for s in specs),
                      tuple(widths(specs, full)), part, shard, nshards)


def test_tp_slices_written_by_two_ranks_merge_to_the_whole_tensors_statistics(
        tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 16)) * 3
    key = RecordKey(step=2, dp=0, microbatch=1, layer=3, site="mlp.pre")
    lost = RecordKey(step=3, dp=0, microbatch=0, layer=3, site="mlp.pre")
    for rank, (lo, hi) in enumerate([(0, 8), (8, 16)]):
        w = PartWriter(tmp_path, rank)
        w.write([record(x[:, lo:hi], key, lo, 16, rank, 2)], [])
        if rank == 0:  # the other slice of this record never arrives
            w.write([record(x[:, lo:hi], lost, lo, 16, rank, 2)], [])
        w.close(dropped=0)
    manifest = merge_capture(tmp_path, {"source": "test"})
    table = Capture(tmp_path).stats()
    assert manifest["incomplete_rows"] == 5 * len(STATS)
    assert set(table.column("step").to_pylist()) == {2}
    assert not (tmp_path / "parts").exists()
    for label in STATS:
        spec = parse_stat(label)
        whole = partials(torch.from_numpy(x), (spec,), Slice(0, 16)).numpy()
        index, values = finish(spec, whole)
        got = table.filter(table.column("stat").to_numpy(zero_copy_only=False) == label)
        got = got.sort_by([("token", "ascending")]).to_pylist()
        assert [r["token"] for r in got] == list(range(5))
        if not spec.info.indexed:
            np.testing.assert_allclose([r["value"] for r in got], values[:, 0], rtol=1e-12)
            continue
        for r, idx, val in zip(got, index, values):
            if label == "topk(3)":  # the same (channel, value) pairs, ties in any order
                assert set(zip(r["index"], r["values"])) == set(zip(idx.tolist(), val.tolist()))
            else:
                assert r["index"] == idx.tolist()
                np.testing.assert_allclose(r["values"], val, rtol=1e-12)


def test_raw_head_slices_join_in_head_order(tmp_path: Path) -> None:
    key = RecordKey(0, 0, 0, 1, "attn.q")
    a = np.arange(2 * 1 * 3 * 4, dtype=np.float32).reshape(2, 1, 3, 4)
    b = -np.arange(2 * 2 * 3 * 4, dtype=np.float32).reshape(2, 2, 3, 4)
    dims = ("sample", "head", "token", "channel")
    for rank, (arr, heads) in enumerate([(a, [1]), (b, [2, 3])]):
        w = PartWriter(tmp_path, rank)
        w.write([], [RawSlice(key, arr, dims, [0, 1, 2], heads, "heads", rank, 2)])
        w.close(dropped=0)
    merge_capture(tmp_path, {})
    cap = Capture(tmp_path)
    (entry,) = cap.raw_index()
    assert entry["heads"] == [1, 2, 3] and entry["dims"] == list(dims)
    np.testing.assert_array_equal(cap.raw(entry), np.concatenate([a, b], axis=1))


def test_a_capture_reads_without_torch(tmp_path: Path) -> None:
    test_raw_head_slices_join_in_head_order(tmp_path)
    code = ("import sys; from megatronapp.scope.storage import Capture; c = Capture(sys.argv[1]); "
            "c.stats(); [c.raw(e) for e in c.raw_index()]; c.injections(); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_query_reads_the_capture_and_no_other_file(tmp_path: Path) -> None:
    test_tp_slices_written_by_two_ranks_merge_to_the_whole_tensors_statistics(tmp_path)
    names, rows = query(tmp_path, "SELECT stat, count(*) FROM stats GROUP BY stat ORDER BY stat")
    assert names[0] == "stat" and dict(rows)["mean"] == 5
    _, pixels = query(tmp_path, "SELECT token, len(values) FROM stats "
                                "WHERE stat = 'pixels_absmax(4)' ORDER BY token")
    assert pixels == [(t, 4) for t in range(5)]
    with pytest.raises(UserError, match="SQL"):
        query(tmp_path, "SELECT * FROM read_csv('/etc/hostname')")
    with pytest.raises(UserError, match="SQL"):
        query(tmp_path, f"SELECT * FROM read_parquet('{tmp_path / 'stats.parquet'}')")
    assert any("mlp.pre" in line for line in summary_lines(tmp_path))


def test_cli_summary_of_a_directory_that_is_not_a_capture_exits_2(tmp_path: Path) -> None:
    res = run_cli("scope", "summary", str(tmp_path))
    assert res.returncode == 2 and "not a MegaScope capture" in res.stderr
    assert res.stderr.strip().count("\n") == 0


def test_full_queue_drops_the_oldest_batches_and_counts_their_records(tmp_path: Path) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(_batches: list[DeviceBatch]) -> None:
        entered.set()
        release.wait(timeout=60)

    writer = AsyncWriter(PartWriter(tmp_path, 0), maxsize=2, on_write=slow)

    def batch(step: int, records: int) -> DeviceBatch:
        return DeviceBatch([DeviceRecord(RecordKey(step, 0, 0, 1, "resid_pre"), rows_of(1),
                                         ("mean",), (2,), torch.tensor([[4.0, float(step)]]))
                            for _ in range(records)])

    writer.submit(batch(0, 1))
    assert entered.wait(timeout=60)  # the writer holds batch 0 and is stuck in it
    for step, n in [(1, 3), (2, 2), (3, 1), (4, 1)]:  # room for two: 1 and 2 are dropped
        writer.submit(batch(step, n))
    release.set()
    writer.close([], [])
    manifest = merge_capture(tmp_path, {})
    steps = sorted(set(Capture(tmp_path).stats().column("step").to_pylist()))
    assert steps == [0, 3, 4]
    assert manifest["dropped_records"] == 5
    assert json.loads(json.dumps(manifest))["ranks"]["0"]["dropped"] == 5
    assert pq.read_table(tmp_path / "stats.parquet").num_rows == 3
