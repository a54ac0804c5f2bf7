"""experiments/scale_table.py: ``--detect-max-s`` measures ``run`` and leaves a
``detect`` estimated over the budget unrun, marked so in the rendered table, and
``--keep-other-sizes`` keeps the recorded rows of other sizes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import scale_table
from experiments.results import ROOT

RECORDED_ROW = {"gpus": 1024, "run_estimate": {"events": 5, "seconds": 1.0, "memory_gb": 0.1,
                                               "fits": True, "line": "x"},
                "bare_timeouts_per_s": 1e6, "run": {"wall_s": 1.0, "cpu_s": 1.0, "peak_gb": 0.1},
                "events": 5, "trace_mb": 1.0,
                "detect_estimate": {"events": 5, "seconds": 2.0, "memory_gb": 0.2, "fits": True,
                                    "line": "y"},
                "detect": {"wall_s": 2.0, "cpu_s": 2.0, "peak_gb": 0.2}, "named": ["compute:1"]}


def test_detect_runs_only_within_the_budget_and_the_limits() -> None:
    est = {"seconds": 100.0, "fits": True}
    assert scale_table.detect_allowed(est, None)
    assert scale_table.detect_allowed(est, 100.0)
    assert not scale_table.detect_allowed(est, 99.0)
    assert not scale_table.detect_allowed({**est, "fits": False}, None)


@pytest.mark.slow  # a run at 64 GPUs and the core ratio, in children
def test_a_size_over_the_detect_budget_is_run_and_its_detect_marked_not_run(
        tmp_path: Path) -> None:
    (tmp_path / "scale_table.json").write_text(json.dumps(
        {"name": "scale_table", "command": "before", "commit": "abc", "date": "d",
         "data": {"rows": [RECORDED_ROW], "core": {}}}))
    scale_table.main(["--gpus", "64", "--core-gpus", "64", "--detect-max-s", "0",
                      "--keep-other-sizes", "--results-dir", str(tmp_path)])
    doc = json.loads((tmp_path / "scale_table.json").read_text())
    row, kept = doc["data"]["rows"]  # by size
    assert kept == {**RECORDED_ROW, "measured": {"command": "before", "commit": "abc", "date": "d"}}
    assert row["gpus"] == 64 and row["run"]["cpu_s"] > 0 and row["events"] > 0
    assert row["detect_estimate"]["seconds"] > 0 and "detect" not in row and "measured" not in row
    line = next(r for r in scale_table.tables(doc)["scale"].splitlines() if r.startswith("| 64 "))
    assert f"not run: est. {row['detect_estimate']['seconds']:,.0f}" in line


def test_gpus_not_whole_pipelines_are_refused_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "experiments.scale_table", "--gpus", "64,100",
                           "--results-dir", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith("multiple of 64: '64,100'")
    assert "Traceback" not in done.stderr and not list(tmp_path.iterdir())
