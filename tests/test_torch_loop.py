"""The closed loop on real ranks: a rank throttled from the start is named
while the job runs, the ranks stop at an iteration boundary, and the job
restarts from its last checkpoint without that rank's replica (dp 4 -> 2, the
same global batch through twice the microbatches), trains to the scenario's
iteration count, and its loss continues the healthy job's. With no fault the
loop never restarts."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .support import ROOT, run_cli

pytestmark = pytest.mark.slow
ITERATIONS = 30  # the scan may lag the ranks on a loaded host: room to stop before the end
EVERY = 2  # iterations between checkpoints
JOB = ["--set", "parallel={tp: 1, pp: 1, dp: 4, microbatches: 2}",
       "--set", "model={layers: 2, hidden: 32, heads: 4, seq_len: 8, vocab: 64, "
                "micro_batch_size: 2}",
       "--set", f"iterations={ITERATIONS}", "--set", "cluster.jitter={}",
       "--set", "cluster.gpus_per_node=1",  # a rank is a node: its replica is what goes
       "--set", "training={optimizer: adam, lr: 0.01}",
       # a loaded machine can make a healthy rank look slow for a while (confidence
       # ~0.5); a 4x throttle is named with more (~0.8) and stands
       "--set", f"mitigation={{action: exclude, restart_s: 1, checkpoint_every: {EVERY}, "
                "min_confidence: 0.7, hold_iterations: 2}"]


def run(out: Path, faults: str) -> dict[str, Any]:
    done = run_cli("run", str(ROOT / "scenarios/throttle.yaml"), "--backend", "torch", *JOB,
                   "--set", f"faults={faults}", "--out", str(out))
    assert done.returncode == 0, done.stderr
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run(tmp_path_factory.mktemp("healthy") / "run", "[]")


def test_a_healthy_job_with_the_loop_on_never_restarts(healthy: dict[str, Any]) -> None:
    assert healthy["mitigation"]["restarts"] == 0
    assert len(healthy["loss_per_iteration"]) == ITERATIONS


def test_a_throttled_rank_is_left_out_and_the_loss_goes_on_from_the_checkpoint(
        tmp_path: Path, healthy: dict[str, Any]) -> None:
    out = tmp_path / "run"
    summary = run(out, "[{kind: throttle, rank: 1, factor: 4}]")
    loop = summary["mitigation"]
    assert loop["restarts"] == 1, (loop, (out / "detections.jsonl").read_text())
    first, second = loop["segments"]
    assert first["stopped_by"]["rank"] == 1 and first["node_left_out"] == 1
    shapes = [(part["dp"], part["microbatches"]) for part in (first, second)]
    assert shapes == [(4, 2), (2, 4)]  # the same global batch on half the replicas
    resumed = second["first_iteration"]
    assert resumed % EVERY == 0 and 0 < resumed <= first["iterations"] < ITERATIONS
    again = json.loads((out / "segment1" / "summary.json").read_text())
    assert again["world_size"] == 2 and again["faults"] == []  # the throttled rank is gone
    assert resumed + len(again["loss_per_iteration"]) == ITERATIONS
    assert (out / "segment1" / "trace.parquet").is_file()
    # The stopped job's iterations up to the checkpoint, then the restarted
    # job's: the healthy job's curve. Before the restart the same ranks ran
    # the same sums (the throttle only sleeps); after it the same samples in
    # another float32 order (tests/test_torch_resume.py: rtol 1e-4).
    joined = summary["loss_per_iteration"][:resumed] + again["loss_per_iteration"]
    np.testing.assert_allclose(joined[:resumed], healthy["loss_per_iteration"][:resumed],
                               rtol=1e-6)
    np.testing.assert_allclose(joined, healthy["loss_per_iteration"], rtol=1e-4)
