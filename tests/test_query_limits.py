"""``query`` and ``scope query`` stop on a signal, and hold a bounded part of
their result: the terminal gets at most ``--max-rows`` rows, ``--out`` gets
every row, a batch at a time, whole or not at all. Real processes, real
signals, a real address-space cap."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from megatronapp.cli import main

from tests.support import ROOT

ADDRESS_SPACE = 3 * 2**30  # bytes: a Python list of 20 M result rows needs more
MANY_ROWS = 20_000_000
HANG_GUARD = 300  # seconds: only so that a broken build fails instead of hanging


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.json"
    path.write_text('[{"ph": "X", "name": "forward", "pid": 0, "ts": 0, "dur": 1}]')
    return path


def _capped() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "megatronapp.cli", *args]


def _env(spill: Path) -> dict[str, str]:
    """DuckDB's private directory goes under ``spill`` (TMPDIR), where a test can see it."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(spill)}


def _run_capped(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    spill = tmp_path / "spill"
    spill.mkdir(exist_ok=True)
    return subprocess.run(_command(*args), env=_env(spill), preexec_fn=_capped, cwd=tmp_path,
                          capture_output=True, text=True, timeout=HANG_GUARD)


# ------------------------------------------------------------------ signals
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_a_long_query_with_one_line(tmp_path, trace, sig):
    spill = tmp_path / "spill"
    spill.mkdir()
    endless = "SELECT count(*) FROM range(100000000000000) a"  # hours of work
    proc = subprocess.Popen(_command("query", str(trace), endless), env=_env(spill),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(HANG_GUARD * 20):  # until the connection is made
            if any(spill.iterdir()) or proc.poll() is not None:
                break
            time.sleep(0.05)
        time.sleep(1.0)  # and the query under way
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=HANG_GUARD)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + sig, err
    assert out == "" and err.splitlines() == [f"megatronapp: interrupted ({sig.name})"]
    assert list(spill.iterdir()) == []  # DuckDB's private directory went with it


# ----------------------------------------------------- bounded result rows
def test_twenty_million_rows_print_the_first_ones_within_the_address_space_cap(tmp_path, trace):
    sql = f"SELECT * FROM range({MANY_ROWS}) t(i)"
    res = _run_capped(tmp_path, "query", str(trace), sql, "--memory-limit", "500MB")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 1 + 10_000 and lines[1].split() == ["0"]
    assert res.stderr.splitlines() == [
        "shown 10,000 of at least 10,001 rows; pass --max-rows N or --out FILE"]
    res = _run_capped(tmp_path, "query", str(trace), sql, "--memory-limit", "500MB", "--json",
                      "--max-rows", "3")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert res.stderr.splitlines() == [
        "shown 3 of at least 4 rows; pass --max-rows N or --out FILE"]


@pytest.mark.parametrize("name", ["rows.parquet", "rows.csv"])
def test_twenty_million_rows_go_whole_to_out_within_the_address_space_cap(tmp_path, trace,
                                                                         name):
    out = tmp_path / name
    res = _run_capped(tmp_path, "query", str(trace), f"SELECT * FROM range({MANY_ROWS}) t(i)",
                      "--memory-limit", "500MB", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [f"wrote {MANY_ROWS:,} rows to {out}"]
    if name.endswith(".parquet"):
        assert pq.read_metadata(out).num_rows == MANY_ROWS
    else:
        column = pcsv.read_csv(out).column("i")
        assert len(column) == MANY_ROWS and column[-1].as_py() == MANY_ROWS - 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["t.json", "spill", name])


def test_holding_too_many_rows_for_memory_is_one_line(tmp_path, trace):
    res = _run_capped(tmp_path, "query", str(trace), f"SELECT * FROM range({MANY_ROWS})",
                      "--memory-limit", "500MB", "--max-rows", str(MANY_ROWS), "--json")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines() == ["megatronapp: query: out of memory holding the rows; "
                                       "pass a smaller --max-rows or --out FILE"]


def test_duckdb_out_of_memory_is_one_line(capsys, trace):
    sql = "SELECT list(i) FROM range(100000000) t(i)"  # a list cannot spill to disk
    assert main(["query", str(trace), sql, "--memory-limit", "64MB"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("megatronapp: SQL: Out of Memory Error")
    assert err[0].endswith("pass a larger --memory-limit or ask for less")


# ---------------------------------------------------------------- --out
def test_out_is_refused_when_it_exists_or_is_an_input_and_replaced_with_force(capsys, trace):
    out = trace.with_name("rows.csv")
    out.write_text("previous\n")
    assert main(["query", str(trace), "SELECT 1 AS one", "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"megatronapp: --out: {out} exists; pass --force to replace it"]
    assert out.read_text() == "previous\n"
    assert main(["query", str(trace), "SELECT 1 AS one", "--out", str(out), "--force"]) == 0
    assert out.read_text() == '"one"\n1\n'
    capsys.readouterr()
    alias = trace.with_suffix(".csv")
    alias.symlink_to(trace)  # the input under another name
    assert main(["query", str(trace), "SELECT 1", "--out", str(alias), "--force"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "is one of the inputs" in err[0] and alias.is_symlink()
    assert main(["query", str(trace), "SELECT 1", "--out", str(trace.with_suffix(".txt"))]) == 2
    assert "name a .parquet or .csv file" in capsys.readouterr().err
    assert sorted(p.name for p in trace.parent.iterdir()) == ["rows.csv", "t.csv", "t.json"]


def test_a_file_inside_the_queried_capture_is_an_input(tmp_path, capsys):
    from megatronapp.scope.storage import PartWriter, merge_capture

    capture = tmp_path / "capture"
    PartWriter(capture, 0).close(dropped=0)
    merge_capture(capture, {"source": "test"})
    stats = capture / "stats.parquet"
    before = stats.read_bytes()
    assert main(["scope", "query", str(capture), "SELECT 1", "--out", str(stats),
                 "--force"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "is one of the inputs" in err[0] and stats.read_bytes() == before


def test_a_failed_query_leaves_no_out_file(capsys, trace):
    out = trace.with_name("rows.parquet")
    assert main(["query", str(trace), "SELECT 1 / 0 FROM range(10) WHERE error('no')",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("megatronapp: SQL:") and "no" in err[0]
    assert sorted(p.name for p in trace.parent.iterdir()) == ["t.json"]


def test_the_row_count_is_a_positive_number(capsys, trace):
    assert main(["query", str(trace), "SELECT 1", "--max-rows", "0"]) == 2
    assert "--max-rows: must be > 0, got '0'" in capsys.readouterr().err


def test_first_rows_says_whether_more_came():
    from megatronapp.scan.query import Rows, run_query
    from megatronapp.trace.events import Event

    events = {0: [Event("forward", 0.0, 1e-3, {})]}
    exact = run_query(events, "SELECT * FROM range(5)", max_rows=5)
    cut = run_query(events, "SELECT * FROM range(6)", max_rows=5)
    assert exact == Rows(["range"], [(i,) for i in range(5)], more=False)
    assert cut == Rows(["range"], [(i,) for i in range(5)], more=True)


class _Held:
    """A row value whose lifetime a weak reference can watch."""


class _RunsOutOfMemory:
    """A connection whose second fetch finds no memory left, after one chunk held."""

    description = [("v",)]

    def __init__(self, first: list[tuple[object, ...]], error: BaseException):
        self._chunks, self._error = [first], error

    def execute(self, sql: str) -> None:
        pass

    def fetchmany(self, n: int) -> list[tuple[object, ...]]:
        if self._chunks:
            return self._chunks.pop()
        raise self._error


@pytest.mark.parametrize("error", [MemoryError(), duckdb.OutOfMemoryException("no memory")])
def test_the_rows_held_are_given_back_before_running_out_of_memory_is_reported(error):
    """Reporting the error needs memory; the traceback keeps the fetching
    frame alive, so the rows it held must already be gone."""
    import gc
    import weakref

    from megatronapp.scan.query import first_rows

    held = _Held()
    watch = weakref.ref(held)
    con = _RunsOutOfMemory([(held,)], error)
    del held
    with pytest.raises(MemoryError) as caught:
        first_rows(con, "SELECT 1", max_rows=10)  # type: ignore[arg-type]
    gc.collect()
    assert caught.traceback and watch() is None


def test_rows_stop_being_held_while_memory_is_left_to_say_so(monkeypatch):
    from megatronapp.scan import query

    rows = 2 * query.CHECK_EVERY_CHUNKS * query.FETCH_ROWS
    con = duckdb.connect()
    assert len(query.first_rows(con, f"SELECT * FROM range({rows})", rows).rows) == rows
    monkeypatch.setattr(query, "available_memory", lambda: query.ROWS_HEADROOM_BYTES - 1)
    with pytest.raises(MemoryError):
        query.first_rows(con, f"SELECT * FROM range({rows})", rows)
