"""``megatronapp query`` sees the events table and nothing else, by default."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import duckdb
import pytest

from megatronapp.cli import main
from megatronapp.errors import UserError
from megatronapp.scan.query import QueryLimits, connect_events, run_query
from megatronapp.trace.events import Event

EVENTS = {0: [Event("forward", 0.0, 1e-3, {"iteration": 0})],
          1: [Event("backward", 1e-3, 2e-3, {"iteration": 0})]}


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "secret.csv"
    path.write_text("a,b\n1,2\n")
    return path


def _refused(sql: str, words: str) -> None:
    with pytest.raises((duckdb.Error, UserError), match=words):
        run_query(EVENTS, sql)


def test_reading_files_is_refused(outside):
    _refused(f"SELECT * FROM read_csv('{outside}')", "disabled")
    _refused("SELECT * FROM read_csv('/etc/passwd')", "disabled")
    _refused(f"SELECT * FROM '{outside}'", "disabled")
    _refused("SELECT * FROM glob('/etc/*')", "disabled")


def test_writing_and_attaching_files_is_refused(tmp_path):
    _refused(f"COPY events TO '{tmp_path / 'leak.csv'}'", "COPY statement is refused")
    _refused(f"ATTACH '{tmp_path / 'other.db'}' AS other", "ATTACH statement is refused")
    _refused(f"EXPORT DATABASE '{tmp_path / 'dump'}'", "EXPORT statement is refused")
    assert list(tmp_path.iterdir()) == []


def test_extensions_cannot_be_installed_or_loaded():
    _refused("INSTALL httpfs", "LOAD statement is refused")
    _refused("LOAD httpfs", "LOAD statement is refused")


@pytest.mark.parametrize("sql", ["SET enable_external_access = true",
                                 "SET lock_configuration = false",
                                 "SET memory_limit = '100GB'", "RESET memory_limit",
                                 "PRAGMA memory_limit = '100GB'"])
def test_the_configuration_is_locked(sql):
    _refused(sql, "statement is refused")  # not even parsed as a query
    with connect_events(EVENTS) as con, pytest.raises(duckdb.Error, match="locked"):
        con.execute(sql)  # and the connection itself refuses it


def test_a_memory_limit_is_set_by_default_and_can_be_chosen():
    limit = run_query(EVENTS, "SELECT current_setting('memory_limit')").rows[0][0]
    assert limit.endswith(("MiB", "GiB")) and not limit.startswith("0")
    chosen = run_query(EVENTS, "SELECT current_setting('memory_limit')",
                       QueryLimits(memory_limit="300MB"))
    assert chosen.rows[0][0] == "286.1 MiB"


def test_the_events_table_still_answers():
    result = run_query(EVENTS, "SELECT rank, name FROM events ORDER BY rank")
    assert result.names == ["rank", "name"]
    assert result.rows == [(0, "forward"), (1, "backward")] and not result.more


def test_external_access_is_an_explicit_option(outside):
    result = run_query(EVENTS, f"SELECT b FROM read_csv('{outside}')",
                       QueryLimits(external_access=True))
    assert result.rows == [(2,)]


def test_the_cli_refuses_by_default_and_allows_on_request(capsys, tmp_path, outside):
    trace = tmp_path / "t.json"
    trace.write_text('[{"ph": "X", "name": "forward", "pid": 0, "ts": 0, "dur": 1}]')
    sql = f"SELECT b FROM read_csv('{outside}')"
    assert main(["query", str(trace), sql]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megatronapp: SQL:") and "disabled" in err[0]
    assert main(["query", str(trace), sql, "--allow-external-access"]) == 0
    assert capsys.readouterr().out.split()[-1] == "2"
    assert main(["query", str(trace), "SELECT 1", "--memory-limit", "lots"]) == 2
    assert "--memory-limit" in capsys.readouterr().err


# ------------------------------------------------ DuckDB's temporary directory
# DuckDB's default temporary directory is ./.tmp, and external access keeps
# its temporary directory allowed: with the default, SQL reached the user's
# files there. Both query commands run here against a working directory
# holding such a file, and against a trace and a capture beside it.
DOT_TMP_TRICKS = ["COPY (SELECT 'x') TO '.tmp/user_notes.csv'",
                  "COPY (SELECT 'x') TO '.tmp/new.csv'",
                  "SELECT * FROM read_csv('.tmp/user_notes.csv')",
                  "SELECT * FROM read_text('.tmp/user_notes.csv')",
                  "SELECT * FROM glob('.tmp/*')",
                  "ATTACH '.tmp/other.db' AS other",
                  "INSTALL httpfs",
                  "SET memory_limit = '100GB'", "RESET memory_limit",
                  "SET temp_directory = '.tmp'", "RESET temp_directory",
                  "SET allowed_directories = ['.']", "SET enable_external_access = true",
                  "PRAGMA memory_limit = '100GB'", "CALL enable_logging()"]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with the user's ``.tmp/user_notes.csv``, a trace
    and an empty capture; DuckDB's private directories go to ``spill/``."""
    from megatronapp.scope.storage import PartWriter, merge_capture

    (tmp_path / ".tmp").mkdir()
    (tmp_path / ".tmp" / "user_notes.csv").write_bytes(b"mine,do not touch\n1,2\n")
    (tmp_path / "t.json").write_text('[{"ph": "X", "name": "forward", "pid": 0, "ts": 0, '
                                     '"dur": 1}]')
    PartWriter(tmp_path / "capture", 0).close(dropped=0)
    merge_capture(tmp_path / "capture", {"source": "test"})
    (tmp_path / "spill").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "spill"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


QUERY_COMMANDS = [["query", "t.json"], ["scope", "query", "capture"]]


@pytest.mark.parametrize("command", QUERY_COMMANDS, ids=["query", "scope-query"])
@pytest.mark.parametrize("sql", DOT_TMP_TRICKS)
def test_sql_cannot_reach_the_working_directory_or_change_the_lock(workdir, capsys, command,
                                                                    sql):
    before = _snapshot(workdir)
    assert main([*command, sql]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 1 and err[0].startswith("megatronapp: SQL:")
    assert _snapshot(workdir) == before  # the user's file byte for byte, nothing new


@pytest.mark.parametrize("command", QUERY_COMMANDS, ids=["query", "scope-query"])
def test_duckdb_spills_into_a_private_directory_removed_afterwards(workdir, capsys, command):
    assert main([*command, "SELECT current_setting('temp_directory') AS d", "--json"]) == 0
    (spill,) = {Path(row["d"]) for row in json.loads(capsys.readouterr().out)}
    assert spill.parent == workdir / "spill" and spill.name.startswith("megatronapp-duckdb-")
    assert list((workdir / "spill").iterdir()) == []


def test_scope_query_has_a_memory_limit_that_can_be_chosen(workdir, capsys):
    sql = "SELECT current_setting('memory_limit') AS m"
    assert main(["scope", "query", "capture", sql, "--memory-limit", "300MB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"m": "286.1 MiB"}]
