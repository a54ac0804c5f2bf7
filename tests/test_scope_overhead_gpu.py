"""MegaScope's GPU overhead table (docs/megascope.md) comes from the runs kept
in experiments/data/: ``python -m experiments.scope_overhead --gpu --reuse``
prints it again on any machine and writes the results file it is rendered from."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from experiments import results
from experiments.scope_overhead import NAME, tables


def test_scope_overhead_gpu_table_is_reproduced_from_the_kept_runs(tmp_path: Path) -> None:
    """``--gpu --reuse`` prints the GPU table from the kept H200 runs without a
    GPU: one row per arm, each median the runs' own; the results file it
    writes renders the same table."""
    root = Path(__file__).resolve().parents[1]
    kept = root / "experiments" / "data" / "scope_overhead_gpu_h200.json"
    no_gpu = {"PATH": "", "PYTHONPATH": str(root), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-m", "experiments.scope_overhead", "--gpu",
                          "--reuse", str(kept), "--results-dir", str(tmp_path)],
                         capture_output=True, text=True, check=True, env=no_gpu, cwd=root).stdout
    runs = json.loads(kept.read_text())["runs"]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip()
            for line in out.splitlines() if line.startswith("| ") and "ms/it" not in line}
    assert set(rows) == set(runs) == {"absent", "every step", "every 10th step",
                                      "every 10th step, pooled"}
    for arm, arm_runs in runs.items():
        assert float(rows[arm]) == round(1e3 * float(np.median(
            [w for run in arm_runs for w in run["wall_s"]])), 2)
    assert f"{max(map(len, runs.values()))} interleaved rounds" in out
    table = tables(results.read(NAME, tmp_path))["gpu"]
    assert table in out
