"""``query`` and ``scope query`` run exactly one read-only SELECT: DuckDB's own
parser says what each statement is, and anything else (a second statement,
PREPARE/EXECUTE, COPY, ATTACH, INSTALL, LOAD, PRAGMA, SET, EXPORT, CREATE) is
one line, exit 2, before the trace is read, with nothing written anywhere.
The SQL stops at ``--max-seconds``; DuckDB's private spill folder is capped."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from megatronapp.cli import main
from megatronapp.trace import columns

from .support import ROOT
from .test_query_sandbox import QUERY_COMMANDS, _snapshot, workdir  # noqa: F401 (a fixture)

# The write that got through before: a prepared COPY into DuckDB's own temporary folder.
PREPARED_COPY = ("PREPARE p AS COPY (SELECT 42) TO $1; "
                 "EXECUTE p(current_setting('temp_directory') || '/probe.csv')")
WRITERS = [PREPARED_COPY,
           "EXECUTE p(1)",
           "PREPARE p AS SELECT 1",
           "SELECT 1; SELECT 2",
           "SELECT 1; COPY (SELECT 1) TO 'x.csv'",
           "COPY (SELECT 42) TO 'probe.csv'",
           "CREATE TABLE t AS SELECT 1",
           "CREATE MACRO m() AS 1",
           "INSERT INTO events SELECT * FROM events",
           "DELETE FROM events",
           "DROP TABLE events",
           "ATTACH ':memory:' AS other",
           "EXPORT DATABASE 'dump'",
           "INSTALL httpfs", "LOAD httpfs",
           "PRAGMA version", "SET threads = 1", "CALL pragma_version()",
           "EXPLAIN ANALYZE SELECT 1",
           "VACUUM", "CHECKPOINT", "BEGIN TRANSACTION"]


@pytest.mark.parametrize("command", QUERY_COMMANDS, ids=["query", "scope-query"])
@pytest.mark.parametrize("sql", WRITERS)
def test_only_one_select_is_run(workdir, capsys, command, sql):
    before = _snapshot(workdir)
    assert main([*command, sql]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 1 and err[0].startswith("megatronapp: SQL:")
    assert _snapshot(workdir) == before  # nothing written, the spill folder removed


def test_the_prepared_copy_writes_nothing_in_the_temporary_folder(workdir, capsys):
    spill = Path(tempfile.gettempdir())
    assert main(["query", "t.json", PREPARED_COPY]) == 2
    assert "2 statements" in capsys.readouterr().err
    assert list(spill.rglob("probe.csv")) == [] and list(spill.iterdir()) == []


@pytest.mark.parametrize("sql", ["SELECT 1", "select 1;", "-- why\nFROM events",
                                 "WITH a AS (SELECT 1 AS x) SELECT * FROM a",
                                 "DESCRIBE events", "SHOW TABLES", "VALUES (1)",
                                 "SELECT 1 UNION ALL SELECT 2"])
def test_read_only_forms_still_answer(workdir, capsys, sql):
    assert main(["query", "t.json", sql]) == 0


def test_the_sql_is_checked_before_the_trace_is_read(tmp_path, capsys):
    assert main(["query", str(tmp_path / "missing"), "DROP TABLE events"]) == 2
    assert "DROP statement is refused" in capsys.readouterr().err


def test_the_spill_folder_is_capped(workdir, capsys):
    sql = "SELECT current_setting('max_temp_directory_size') AS cap"
    assert main(["query", "t.json", sql, "--json"]) == 0
    cap = json.loads(capsys.readouterr().out)[0]["cap"]
    assert cap.endswith(("MiB", "GiB")) and not cap.startswith("0")


def test_a_query_stops_at_max_seconds(workdir, capsys):
    endless = "SELECT count(*) FROM range(1000000000000) a, range(1000000000000) b"
    assert main(["query", "t.json", endless, "--max-seconds", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--max-seconds" in err[0] and "stopped" in err[0]


def test_query_on_a_stored_run_builds_no_event_objects(tmp_path, capsys, monkeypatch):
    assert main(["run", str(ROOT / "scenarios/throttle.yaml"), "--out", str(tmp_path / "run"),
                 "--quiet"]) == 0
    events = json.loads((tmp_path / "run" / "summary.json").read_text())["trace"]["events"]
    capsys.readouterr()

    def refuse(*_args: object) -> None:
        raise AssertionError("an Event object per row was built")

    monkeypatch.setattr(columns, "events_of_rows", refuse)
    assert main(["query", str(tmp_path / "run"),
                 "SELECT count(*) AS n, count(related_sync_op) AS linked FROM events",
                 "--json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["n"] == events and 0 < row["linked"] < row["n"]
