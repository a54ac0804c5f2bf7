"""Every argument that scales time or memory is priced before any work: a
job that does not fit is one line naming the limit, exit 2, refused in
bounded memory (each command runs here in a child capped at 3 GB of address
space, and must say so well within two minutes)."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from .support import ROOT, capped_cli, one_line_error

def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return capped_cli(*args)


refused = one_line_error


@pytest.fixture
def run16(throttle_run: Path, tmp_path: Path) -> Path:
    """A 16-rank simulated run of 4 iterations, this test's own."""
    shutil.copytree(throttle_run, tmp_path / "run")
    return tmp_path / "run"


def test_predict_prices_its_simulation_first():
    refused(cli("predict", "scenarios/throttle.yaml", "--set", "parallel.dp=1000000"),
            "limits: this prediction", "--no-limits")


def test_export_trace_refuses_a_rank_range_beyond_the_run_without_expanding_it(run16, tmp_path):
    line = refused(cli("export-trace", str(run16), "--ranks", "0-2147483647",
                       "--out", str(tmp_path / "x.json")), "--ranks", "0..15")
    assert "2147483647" in line and not (tmp_path / "x.json").exists()


def test_export_trace_leaves_out_iterations_the_run_does_not_have(run16, tmp_path):
    out = tmp_path / "x.json"
    done = cli("export-trace", str(run16), "--ranks", "0-1", "--iterations", "0-2147483647",
               "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "note: --iterations: the run has 0..3; selected 4 of them" in done.stderr
    events = json.loads(out.read_text())["traceEvents"]
    assert {e["args"]["iteration"] for e in events if "iteration" in e.get("args", {})} == \
        {0, 1, 2, 3}


@pytest.mark.parametrize("spec", [{"seeds": 100_000_000},
                                  {"random": {"draws": 1_000_000_000,
                                              "keys": {"seed": {"choice": [1]}}}}],
                         ids=["1e8 seeds", "1e9 draws"])
def test_a_sweep_is_counted_and_priced_before_any_point_is_built(tmp_path, spec):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"scenario": str(ROOT / "scenarios/throttle.yaml"), **spec}))
    refused(cli("sweep", str(path), "--out", str(tmp_path / "t.parquet")), "limits: sweep s",
            "00,000,000 runs")
    assert list(tmp_path.iterdir()) == [path]


def test_validate_detector_prices_its_trials_first(tmp_path):
    refused(cli("validate-detector", "--trials", "1000000000", "--csv", str(tmp_path / "v.csv")),
            "limits: validate-detector (1,000,000,000 trials)")
    assert list(tmp_path.iterdir()) == []


def test_query_sizes_the_trace_and_takes_the_same_options_as_detect(run16):
    line = refused(cli("query", str(run16), "SELECT count(*) FROM events", "--max-seconds",
                       "0.001"), "limits: query on", "--max-seconds")
    assert "would take too long" in line
