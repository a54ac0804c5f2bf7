"""Every experiment runs as ``python -m experiments.NAME`` from the repository's
root and answers ``--help`` with its usage, before doing any work."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "experiments").glob("*.py")
                     if 'if __name__ == "__main__":' in p.read_text())


def test_the_experiments_are_found() -> None:
    assert {"render", "published_runs", "kernel_bench", "online_table"} <= set(EXPERIMENTS)


@pytest.mark.slow  # one interpreter per experiment
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_an_experiment_answers_help_with_its_usage(name: str, tmp_path: Path) -> None:
    results = ROOT / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.glob("*.json")}
    done = subprocess.run([sys.executable, "-m", f"experiments.{name}", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:"), done.stdout[:500]
    assert {p.name: p.stat().st_mtime_ns for p in results.glob("*.json")} == before
