"""``megatronapp query`` sees the events table and nothing else, by default."""
from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from megatronapp.cli import main
from megatronapp.scan.query import QueryLimits, run_query
from megatronapp.tracer import Event

EVENTS = {0: [Event("forward", 0.0, 1e-3, {"iteration": 0})],
          1: [Event("backward", 1e-3, 2e-3, {"iteration": 0})]}


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "secret.csv"
    path.write_text("a,b\n1,2\n")
    return path


def _refused(sql: str, words: str) -> None:
    with pytest.raises(duckdb.Error, match=words):
        run_query(EVENTS, sql)


def test_reading_files_is_refused(outside):
    _refused(f"SELECT * FROM read_csv('{outside}')", "disabled")
    _refused("SELECT * FROM read_csv('/etc/passwd')", "disabled")
    _refused(f"SELECT * FROM '{outside}'", "disabled")
    _refused("SELECT * FROM glob('/etc/*')", "disabled")


def test_writing_and_attaching_files_is_refused(tmp_path):
    _refused(f"COPY events TO '{tmp_path / 'leak.csv'}'", "disabled")
    _refused(f"ATTACH '{tmp_path / 'other.db'}' AS other", "disabled")
    _refused(f"EXPORT DATABASE '{tmp_path / 'dump'}'", "disabled")
    assert list(tmp_path.iterdir()) == []


def test_extensions_cannot_be_installed_or_loaded():
    _refused("INSTALL httpfs", "disabled")
    _refused("LOAD httpfs", "disabled")


@pytest.mark.parametrize("sql", ["SET enable_external_access = true",
                                 "SET lock_configuration = false",
                                 "SET memory_limit = '100GB'", "RESET memory_limit",
                                 "PRAGMA memory_limit = '100GB'"])
def test_the_configuration_is_locked(sql):
    _refused(sql, "locked")


def test_a_memory_limit_is_set_by_default_and_can_be_chosen():
    names, rows = run_query(EVENTS, "SELECT current_setting('memory_limit')")
    limit = rows[0][0]
    assert limit.endswith(("MiB", "GiB")) and not limit.startswith("0")
    _, rows = run_query(EVENTS, "SELECT current_setting('memory_limit')",
                        QueryLimits(memory_limit="300MB"))
    assert rows[0][0] == "286.1 MiB"


def test_the_events_table_still_answers():
    names, rows = run_query(EVENTS, "SELECT rank, name FROM events ORDER BY rank")
    assert names == ["rank", "name"] and rows == [(0, "forward"), (1, "backward")]


def test_external_access_is_an_explicit_option(outside):
    _, rows = run_query(EVENTS, f"SELECT b FROM read_csv('{outside}')",
                        QueryLimits(external_access=True))
    assert rows == [(2,)]


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
