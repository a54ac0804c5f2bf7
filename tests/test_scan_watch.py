"""``megatronapp watch DIR``: on-line MegaScan following a directory while a job
writes it (torch.profiler's one file per rank per cycle), or a run directory."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .support import ROOT, kineto_cycle_file, run_cli

WORLD, STEPS_PER_CYCLE, CYCLES, ONSET = 4, 5, 3, 7  # rank 1 slows down from step 7 on

# A job's profiler writing its files: each in two halves with a pause between
# (a reader sees it half-written), one rank after another, cycle after cycle.
WRITER = """
import json, sys, time
from pathlib import Path
plan = json.loads(Path(sys.argv[1]).read_text())
for name, text in plan:
    with open(Path(sys.argv[2]) / name, "w") as f:
        f.write(text[:len(text) // 2]); f.flush(); time.sleep(0.2); f.write(text[len(text) // 2:])
"""


def profiler_plan(onset: int = ONSET) -> list[tuple[str, str]]:
    plan = []
    for cycle in range(CYCLES):
        steps = range(cycle * STEPS_PER_CYCLE, (cycle + 1) * STEPS_PER_CYCLE)
        slow = {s: 1.3 for s in steps if s >= onset}
        for rank in range(WORLD):
            plan.append((f"host_{4000 + rank}.{1000 + cycle}.pt.trace.json",
                         json.dumps(kineto_cycle_file(rank, WORLD, steps, slow))))
    return plan


@pytest.mark.parametrize("onset", [ONSET, 0])  # slow from a step on, or throughout
def test_watch_reports_the_slow_rank_while_a_job_writes_its_profiler_files(
        tmp_path: Path, onset: int) -> None:
    (tmp_path / "plan.json").write_text(json.dumps(profiler_plan(onset)))
    target = tmp_path / "profile"
    target.mkdir()
    job = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "plan.json"), str(target)])
    try:
        done = run_cli("watch", str(target), "--idle", "3", "--interval", "0.1", "--json")
    finally:
        job.wait()
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["event"], r["kind"], r["rank"]) for r in records] == [("named", "compute", 1)]
    assert onset <= records[0]["first_seen"] <= records[0]["iteration"] <= onset + 3


def test_watch_of_a_run_directory_reports_what_the_run_detected(tmp_path: Path) -> None:
    out = tmp_path / "run"
    ran = run_cli("run", str(ROOT / "scenarios/throttle.yaml"), "--set", "iterations=6",
                  "--detect", "--out", str(out))
    assert ran.returncode == 0, ran.stderr
    done = run_cli("watch", str(out), "--json")
    assert done.returncode == 0, done.stderr
    watched = [json.loads(line) for line in done.stdout.splitlines()]
    logged = [json.loads(line) for line in (out / "detections.jsonl").read_text().splitlines()]
    assert watched and [(w["event"], w["kind"], w["rank"], w["iteration"]) for w in watched] == \
        [(d["event"], d["kind"], d["rank"], d["iteration"]) for d in logged]


def test_ctrl_c_ends_a_watch_with_one_line_and_status_130(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    watch = subprocess.Popen([sys.executable, "-m", "megatronapp.cli", "watch", str(tmp_path),
                              "--interval", "0.1"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        watch.wait(timeout=3)  # still following: nothing ends a watch of an empty directory
    except subprocess.TimeoutExpired:
        pass
    assert watch.returncode is None
    watch.send_signal(signal.SIGINT)
    out, err = watch.communicate(timeout=60)
    assert watch.returncode == 130
    assert err.splitlines() == ["megatronapp: interrupted (SIGINT)"]
    assert list(tmp_path.iterdir()) == []


def test_watch_of_a_missing_directory_is_one_line(tmp_path: Path) -> None:
    done = run_cli("watch", str(tmp_path / "nowhere"))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"megatronapp: DIR: {tmp_path / 'nowhere'} is not a directory"]


def test_a_profiler_file_of_no_distributed_job_is_one_line_naming_it(tmp_path: Path) -> None:
    data = kineto_cycle_file(0, WORLD, range(2), {})
    del data["distributedInfo"]
    path = tmp_path / "host_1.1.pt.trace.json"
    path.write_text(json.dumps(data))
    done = run_cli("watch", str(tmp_path), "--idle", "1", "--interval", "0.1")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"megatronapp: DIR: {path} is not a torch.profiler trace of a distributed job"]


def test_a_confidence_outside_zero_to_one_is_one_line_naming_it(tmp_path: Path) -> None:
    done = run_cli("watch", str(tmp_path), "--min-confidence", "1.5")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "megatronapp: --min-confidence: must be a probability in [0, 1], got 1.5"]
