"""The distributed optimizer for real: the torch interpreter's reduce-scatter
and all-gather train exactly like one process; calibration from a real run."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from backends.torch.launch import spawn_run
from backends.torch.stages import TrainOptions
from megatronapp.scenario.config import load_scenario, parse_scenario

from .support import ROOT, SGD, full_model, run_cli, torch_scenario

CPU_TINY = ROOT / "scenarios" / "fidelity" / "cpu_tiny.yaml"


@pytest.mark.slow
def test_distributed_optimizer_trains_like_a_single_process() -> None:
    s = torch_scenario({"dp": 2, "microbatches": 2}, iterations=2,
                 training={"distributed_optimizer": True})
    run, results = spawn_run(s, SGD)
    names = {e.name for ev in run.events.values() for e in ev}
    assert {"dp_reduce_scatter", "dp_param_all_gather"} <= names and "dp_allreduce" not in names
    # One process with the whole global batch, from the same initial weights: the
    # second iteration's losses match only if the gathered weights are right.
    ref = parse_scenario({**s.model_dump(mode="json"), "training": {},
                          "parallel": {"microbatches": 4}})
    _, (single,) = spawn_run(ref, TrainOptions("sgd", SGD.lr, True, full_model(results, s, "before")))
    for iteration in (0, 1):
        got = {r.rank * 2 + mb: loss for r in results  # rank = dp index (tp = pp = 1)
               for mb, loss in r.losses[iteration].items()}
        assert got == pytest.approx(single.losses[iteration], rel=1e-5)


FITTED_FROM_A_REAL_RUN = ("cluster.gpu.efficiency", "cluster.gpu.backward_ratio",
                          "cluster.gpu.hbm_tbps", "cluster.gpu.op_overhead_us",
                          "cluster.links.intra_node_latency_us")


@pytest.mark.slow
@pytest.mark.alone  # the profile's and the run's own timing of one run are compared
def test_calibrate_fits_every_constant_from_a_real_torch_run(tmp_path: Path) -> None:
    """A real run's trace carries what calibrate needs: forward times of first,
    middle and last chunks, backward, the optimizer step, small collectives."""
    run_dir, out = tmp_path / "measured", tmp_path / "calibrated.yaml"
    proc = run_cli("run", str(CPU_TINY), "--backend", "torch", "--out", str(run_dir),
                   "--quiet", "--set", "iterations=3", "--profile")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("calibrate", str(run_dir), "--scenario", str(CPU_TINY), "--out", str(out),
                   "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    _profile_agrees(run_dir, report, tmp_path / "from_profile.yaml")
    assert set(report["evidence"]["forward_s_by_chunk_kind"]) == {"first", "middle", "last"}
    assert set(FITTED_FROM_A_REAL_RUN) <= set(report["settings"])
    assert all(math.isfinite(v) and v >= 0 for v in report["settings"].values())
    calibrated = load_scenario(out)  # validated like any scenario
    for key in FITTED_FROM_A_REAL_RUN:
        _, group, name = key.split(".")
        assert getattr(getattr(calibrated.cluster, group), name) == pytest.approx(
            report["settings"][key], rel=1e-5)


def _profile_agrees(run_dir: Path, from_run: dict, out: Path) -> None:
    """The run's torch.profiler trace (its own ranges around the same ops, for
    three iterations where the scenario file says six: a profile may hold any
    whole number of them) is read and placed like the run's own trace: each
    chunk kind's median forward and the backward ratio agree. Measured here
    1-2% and 0.2% apart on a quiet machine; under a loaded CI run the forward
    medians stayed within 15% while the optimizer step, a range that also
    holds the interpreter's work around the op, was 39% apart, so it is not
    compared. Exact placement is tested on a simulated run's profile
    (tests/test_fidelity_profiled.py). The three compute constants fitted
    from three medians are not compared either: a few percent between medians
    changes which of them the non-negative fit uses (efficiency 0.173 against
    0.209 once)."""
    proc = run_cli("calibrate", str(run_dir / "profile"), "--scenario", str(CPU_TINY),
                   "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    profiled = json.loads(proc.stdout)
    forward = profiled["evidence"]["forward_s_by_chunk_kind"]
    assert set(forward) == set(from_run["evidence"]["forward_s_by_chunk_kind"])
    for kind, seconds in forward.items():
        assert seconds == pytest.approx(from_run["evidence"]["forward_s_by_chunk_kind"][kind],
                                        rel=0.25), kind
    assert profiled["settings"]["cluster.gpu.backward_ratio"] == pytest.approx(
        from_run["settings"]["cluster.gpu.backward_ratio"], rel=0.15)
