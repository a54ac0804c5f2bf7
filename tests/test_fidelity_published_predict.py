"""``megatronapp predict`` on a published row's scenario prints the published
figure and the error, and they are what the one generated table
(``python -m experiments.published_runs``, results/published_runs.json) shows."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments import results
from megatronapp.fidelity.predict import steady_state_s
from megatronapp.fidelity.published import predicted_row_s, published_row_for, published_runs
from sim import simulate_iteration_times

from .support import ROOT, run_cli

CHEAP = ("Megatron-LM README, Megatron-Core r0.8.0 on H100, 1.7B",
         "Narayanan et al. 2021, Table 1, row 2")


def row(source: str):  # type: ignore[no-untyped-def]
    (found,) = [r for r in published_runs(ROOT) if r.source == source]
    return found


def scenario_path(source: str) -> Path:
    runs = (ROOT / "scenarios" / "published" / "runs.yaml").read_text()
    entry = runs.split(f"- source: {source}\n", 1)[1]
    return ROOT / "scenarios" / "published" / entry.split("scenario: ", 1)[1].split("\n", 1)[0]


@pytest.mark.parametrize("source", CHEAP)
def test_predict_prints_the_published_figure_and_the_error(source: str) -> None:
    r = row(source)
    printed = json.loads(run_cli("predict", str(scenario_path(source)), "--replica",
                                 "--quiet", "--json").stdout)
    published = printed["published"]
    assert published["source"] == source and not published["overridden"]
    assert published["iteration_s"] == pytest.approx(r.iteration_s, rel=1e-12)
    assert published["error"] == pytest.approx(r.iteration_s / printed["iteration_s"] - 1,
                                               rel=1e-12)
    assert published["role"] == ("fitted" if r.fitted else "held out")
    text = run_cli("predict", str(scenario_path(source)), "--replica", "--quiet").stdout
    assert f"error: {published['error'] * 100:+.1f}%" in text


@pytest.mark.parametrize("source", CHEAP)
def test_the_generated_table_holds_what_predict_prints(source: str) -> None:
    """The table README and the docs render is what predict prints for the row
    (a results file made with other constants or code fails here)."""
    doc = results.read("published_runs")
    (entry,) = [e for e in doc["data"]["rows"] if e["source"] == source]
    predicted, _ = predicted_row_s(row(source), lambda s: steady_state_s(
        simulate_iteration_times(s, replica=True)))
    assert entry["predicted_s"] == pytest.approx(predicted, rel=1e-9)


def test_a_scenario_that_is_no_published_row_prints_no_published_figure(tmp_path: Path) -> None:
    copy = tmp_path / "row.yaml"
    copy.write_text(scenario_path(CHEAP[0]).read_text())
    assert published_row_for(copy) is None
    printed = json.loads(run_cli("predict", str(copy), "--replica", "--quiet", "--json").stdout)
    assert printed["published"] is None


def test_a_published_row_changed_by_set_says_so() -> None:
    out = run_cli("predict", str(scenario_path(CHEAP[0])), "--replica", "--quiet",
                  "--set", "parallel.dp=24").stdout
    assert "changed by --set: not the published run" in out
