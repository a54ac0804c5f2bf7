"""MegaScope's GPU overhead table (docs/megascope.md) comes from the runs kept
in paper_figs/data/: ``paper_figs/scope_overhead.py --gpu --reuse`` prints it
again on any machine."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np


def test_scope_overhead_gpu_table_is_reproduced_from_the_kept_runs() -> None:
    """``scope_overhead.py --gpu --reuse`` prints the GPU table from the kept
    H200 runs without a GPU: one row per arm, each median the runs' own."""
    root = Path(__file__).resolve().parents[1]
    kept = root / "paper_figs" / "data" / "scope_overhead_gpu_h200.json"
    no_gpu = {"PATH": "", "PYTHONPATH": str(root), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(root / "paper_figs" / "scope_overhead.py"), "--gpu",
                          "--reuse", str(kept)], capture_output=True, text=True, check=True,
                         env=no_gpu).stdout
    runs = json.loads(kept.read_text())["runs"]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip()
            for line in out.splitlines() if line.startswith("| ") and "ms/it" not in line}
    assert set(rows) == set(runs) == {"absent", "every step", "every 10th step",
                                      "every 10th step, pooled"}
    for arm, arm_runs in runs.items():
        assert float(rows[arm]) == round(1e3 * float(np.median(
            [w for run in arm_runs for w in run["wall_s"]])), 2)
    assert f"{max(map(len, runs.values()))} interleaved rounds" in out
