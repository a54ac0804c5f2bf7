"""The frozen held-out set (``tests/data/heldout``, recorded by
``tests/zoo_heldout/record.py``): its plan covers every job and fault, and
its manifest and its traces agree. Nothing here runs a detector on it:
nothing may be chosen by looking at results on the held-out set."""
from __future__ import annotations

import gzip
import json
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.zoo_heldout import record

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "tests" / "data" / "heldout"
FAULTS = ("slow-1.5x", "slow-2x", "extra-calls-2x", "loader-stall", "step-stall",
          "intermittent-2x-every-3", "noisy-neighbour", "two-slowed-2x")
STALL_MS = 50.0


def plan() -> list[record.Run]:
    return [run for job in record.JOBS
            for run in record.healthy_runs(job) + record.fault_runs(job, STALL_MS)]


# ------------------------------------------------------------------ the plan
def test_the_plan_runs_every_job_healthy_and_under_every_fault_once():
    runs = plan()
    assert len({r.name for r in runs}) == len(runs)
    for job in record.JOBS:
        names = [r.name for r in runs if r.job is job]
        assert sum("-healthy-" in n for n in names) == record.HEALTHY_RUNS
        assert all(f"{job.name}-{fault}" in names for fault in FAULTS)
    assert sum(not r.faults for r in runs) >= 30  # a 3% false-alarm rate is measurable


def test_every_point_to_point_channel_is_slowed_with_and_without_peers_recorded():
    for job in record.JOBS:
        links = [(f, r.record_shapes) for r in plan() if r.job is job
                 for f in r.faults if f["kind"] == "slow_link"]
        for channel in job.channels:
            on_it = [(f, shapes) for f, shapes in links if f["channel"] == channel.kind]
            assert {shapes for _, shapes in on_it} == {True, False}
            for fault, _ in on_it:
                assert (fault["sender"], fault["receiver"]) in channel.pairs
                assert record.LINK_MS[0] <= fault["nominal_delay_ms"] <= record.LINK_MS[1]
                seconds = fault["message_bytes"] * 8 / (fault["mbit"] * 1e6)
                assert seconds * 1e3 == pytest.approx(fault["nominal_delay_ms"], rel=0.01)
        assert any(len({f["kind"] for f in r.faults}) == 2 for r in plan()
                   if r.job is job) == bool(job.channels)  # a slowed rank and a slow link


def test_drawn_faults_fit_their_job():
    for run in plan():
        for fault in run.faults:
            if fault["kind"] == "loader_stall":
                assert set(fault["ranks"]) <= set(run.job.readers)
            if fault["kind"] == "slow_rank" and len(fault["ranks"]) == 2:
                assert frozenset(fault["ranks"]) not in run.job.exclusive
    assert [r.flags for r in plan()] == [r.flags for r in plan()]  # drawn, not random


def test_the_recorder_refuses_to_overwrite_a_frozen_set(tmp_path, capsys):
    (tmp_path / "manifest.json").write_text("{}")
    assert record.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


# ------------------------------------------------------------- the frozen set
@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    return dict(json.loads((HELDOUT / "manifest.json").read_text()))


def trace_rank(path: Path) -> int:
    """The rank in a gzipped trace's ``distributedInfo`` (near its start)."""
    with gzip.open(path, "rt") as f:
        head = f.read(8192)
    info, _ = json.JSONDecoder().raw_decode(head, head.index("{", head.index('"distributedInfo"')))
    return int(info["rank"])


def test_every_run_folder_is_in_the_manifest_with_one_trace_per_rank(manifest):
    runs = {e["run"] for e in manifest["runs"]}
    assert len(runs) == len(manifest["runs"])
    assert {p.name for p in HELDOUT.iterdir() if p.is_dir()} == runs
    for run in runs:
        files = sorted((HELDOUT / run).iterdir())
        assert all(p.name.endswith(".pt.trace.json.gz") for p in files), run
        assert sorted(map(trace_rank, files)) == list(range(record.WORLD)), run


def test_the_manifest_records_each_planned_run_as_the_recorder_plans_it(manifest):
    """Each run's command is what the recorder plans for it today (the
    stalls sized by the first healthy run it recorded), its faults hit
    traced steps, and what its traces showed is recorded."""
    entries = manifest["runs"]
    planned = {run.name: run for job in record.JOBS for run in
               record.healthy_runs(job) + record.fault_runs(job,
                                                            record.stall_ms(entries, job))}
    assert {e["run"] for e in entries} == set(planned)
    for entry in entries:
        run = planned[entry["run"]]
        out = Path("tests/data/heldout") / run.name
        assert entry["command"].split() == record.command(run, out), run.name
        assert entry["traced_steps"] == record.TRACED
        for fault in entry["faults"]:
            assert set(fault["steps_hit"]) <= set(record.TRACED)
            assert fault["kind"] in entry["realized"]
        assert {"date", "load", "realized"} <= set(entry)


def test_the_set_names_the_commit_that_froze_its_jobs(manifest):
    frozen = manifest["frozen_at_commit"]
    ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", frozen, "HEAD"], cwd=ROOT)
    assert ancestor.returncode == 0
    assert {"host", "cpu", "cores", "torch"} <= set(manifest["machine"])


def test_the_set_holds_enough_healthy_runs_and_every_fault_kind(manifest):
    kinds = Counter(f["kind"] for e in manifest["runs"] for f in e["faults"])
    assert sum(not e["faults"] for e in manifest["runs"]) >= 30
    assert set(kinds) == {"slow_rank", "extra_calls", "loader_stall", "optimizer_step_stall",
                          "noisy_neighbour", "slow_link"}


def test_the_readme_forbids_choosing_anything_by_the_held_out_results():
    text = " ".join((HELDOUT / "README.md").read_text().split())
    assert "nothing may be chosen by looking at results on it" in text.lower()
