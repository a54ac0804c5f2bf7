"""Every table in README and docs is what its results file renders to."""
from __future__ import annotations

from pathlib import Path

from experiments import render
from experiments.results import Run


def test_docs_tables_match_their_results_files(capsys):
    assert render.main(["--check"]) == 0, capsys.readouterr().out


def test_a_block_that_differs_from_its_results_file_is_rerendered(tmp_path: Path, monkeypatch):
    # a results file written by the real writer, and a doc whose block was edited by hand
    Run("demo_probe", ["--x", "1"], [0.0, 0.0, 0.0]).record({"rows": [[1, 2.5]]}, tmp_path)
    monkeypatch.setattr(render, "_tables_of", lambda name: lambda doc: {
        "main": render.markdown_table(["a", "b"], doc["data"]["rows"])})
    stale = "intro\n<!-- results: demo_probe main -->\n| old |\n<!-- /results -->\nend\n"
    new, problems = render.rendered(stale, tmp_path)
    assert not problems
    assert "| 1 | 2.5 |" in new and "| old |" not in new
    assert new.startswith("intro\n") and new.endswith("<!-- /results -->\nend\n")


def test_a_block_without_its_results_file_is_a_problem(tmp_path: Path):
    stale = "<!-- results: demo_missing main -->\n| old |\n<!-- /results -->\n"
    new, problems = render.rendered(stale, tmp_path)
    assert problems and "demo_missing" in problems[0]
    assert new == stale


def test_markdown_table_aligns_numbers_right():
    table = render.markdown_table(["job", "ms"], [["a", 1.5]], align="lr")
    assert table.splitlines()[1] == "|---|---:|"
    assert table.splitlines()[2] == "| a | 1.5 |"
