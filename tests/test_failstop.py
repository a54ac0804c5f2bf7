"""Fail-stop faults over a long job: the timeline of crashes, checkpoints and
restarts, Young/Daly's optimum reproduced by the sweep, and ``megatronapp
failstop`` on a scenario."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatronapp.mitigate.failstop import (FailStopJob, failstop_run, geometric_grid, sweep,
                                           young_daly_s)

from .support import ROOT, run_cli

GRID_RATIO = 1.25


def test_without_failures_the_job_pays_its_checkpoints_only() -> None:
    job = FailStopJob(iteration_s=2.0, iterations=100, checkpoint_s=5.0, restart_s=60.0,
                      mtbf_s=math.inf)
    run = failstop_run(job, 30, np.random.default_rng(0))
    # checkpoints after steps 30, 60 and 90; none after the last step
    assert run.checkpoints_s == 15.0 and run.failures == 0
    assert run.wall_s == pytest.approx(200.0 + 15.0)
    assert run.goodput == pytest.approx(200.0 / 215.0)


def test_a_failure_loses_the_work_since_the_last_checkpoint_and_pays_the_restart() -> None:
    class OneFailure:
        """Draws: a failure 75 s in, then none."""

        def __init__(self) -> None:
            self.draws = iter([75.0])

        def exponential(self, _mean: float) -> float:
            return next(self.draws, math.inf)

    job = FailStopJob(iteration_s=10.0, iterations=10, checkpoint_s=5.0, restart_s=100.0,
                      mtbf_s=1e9)
    run = failstop_run(job, 3, OneFailure())  # type: ignore[arg-type]
    # chunks of 3 steps + a checkpoint take 35 s: two are saved by 70 s, 5 s of work is lost
    assert run.failures == 1 and run.lost_s == pytest.approx(5.0)
    remaining = 4 * 10.0 + 5.0  # steps 7-10 from the checkpoint at 6, one more checkpoint
    assert run.wall_s == pytest.approx(75.0 + 100.0 + remaining)
    assert run.checkpoints_s == pytest.approx(3 * 5.0)


def test_more_failures_cost_more_on_the_same_draws() -> None:
    base = FailStopJob(1.0, 20000, 10.0, 120.0, 5000.0)
    worse = FailStopJob(1.0, 20000, 10.0, 120.0, 1000.0)
    assert (failstop_run(worse, 100, np.random.default_rng(3)).goodput
            < failstop_run(base, 100, np.random.default_rng(3)).goodput)


@settings(max_examples=15, deadline=None)
@given(ratio=st.floats(1e-4, 1e-2), mtbf_s=st.floats(1e3, 1e6), seed=st.integers(0, 1000),
       offset=st.floats(0.0, 1.0))
def test_the_best_swept_interval_is_young_and_dalys(ratio: float, mtbf_s: float, seed: int,
                                                    offset: float) -> None:
    """Over checkpoint costs and MTBFs where Young's first-order optimum holds
    (cost well below the MTBF), the sweep's best interval is within one grid
    step of sqrt(2 x cost x MTBF), whatever the grid's phase against it."""
    checkpoint_s = ratio * mtbf_s
    optimum_s = young_daly_s(checkpoint_s, mtbf_s)
    step_s = optimum_s / 40.0  # 40 steps between checkpoints at the optimum
    job = FailStopJob(step_s, int(3000 * mtbf_s / step_s), checkpoint_s, 0.1 * mtbf_s, mtbf_s)
    center = optimum_s / step_s * GRID_RATIO ** offset  # a grid not centred on the answer
    runs = sweep(job, geometric_grid(center, GRID_RATIO, 6), seed)
    best = max(runs, key=lambda r: r.goodput)
    assert abs(math.log(best.checkpoint_every * step_s / optimum_s)) <= math.log(GRID_RATIO) * 1.01


def test_failstop_prices_a_scenario_and_sweeps_its_interval(tmp_path) -> None:
    scenario = tmp_path / "crashes.yaml"
    scenario.write_text(
        "seed: 1\niterations: 200000\nparallel: {pp: 2, dp: 2, microbatches: 4}\n"
        "model: {layers: 4, hidden: 256, heads: 4, seq_len: 256, vocab: 1024}\n"
        "mitigation: {checkpoint_every: 10, checkpoint_s: 0.5, restart_s: 30}\n"
        "faults:\n  - {kind: crash, mtbf_hours: 0.01, cause: GPU}\n")
    proc = run_cli("failstop", str(scenario), "--sweep", "--json", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["mtbf_s"] == pytest.approx(0.01 * 3600 / 4)  # four devices
    everies = [r["checkpoint_every"] for r in out["runs"]]
    assert 10 in everies and len(everies) > 5
    assert all(0 < r["goodput"] < 1 and r["failures"] > 0 for r in out["runs"])


def test_failstop_without_a_failure_rate_is_one_line(tmp_path) -> None:
    scenario = tmp_path / "healthy.yaml"
    scenario.write_text("iterations: 100\n")
    proc = run_cli("failstop", str(scenario), cwd=ROOT)
    assert proc.returncode == 2 and "faults" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
