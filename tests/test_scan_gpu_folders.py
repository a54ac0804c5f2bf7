"""Folders of torch.profiler files as users have them: several profiling
cycles per rank (``schedule(..., repeat=N)``), the same rank twice in one
cycle, ranks missing from the job; GPU time over overlapping streams; and
the commands that write (``align``, ``plot``, ``report``) never writing into
a trace folder."""
from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import pytest

from megatronapp.scan.ingest.folders import FileWindow, group_cycles, rank_ranges
from megatronapp.scan.ingest.gpu_time import iteration_gpu_times, rank_gpu_time
from megatronapp.scan.ingest.load import TraceError
from megatronapp.trace.events import Event

from .support import kineto_cycle_file, run_cli

PUBLIC = Path(__file__).resolve().parent / "data" / "gpu_public"
WORLD, STEPS, SLOW = 4, 5, 1.6


def two_cycles(folder: Path, ranks: range = range(WORLD), slow_in: int = 1) -> Path:
    """What ``tensorboard_trace_handler`` writes under ``schedule(repeat=2)``:
    one file per rank per cycle, named by host, pid and time; rank 1 is slow
    in cycle ``slow_in`` (0 or 1) only."""
    folder.mkdir(parents=True, exist_ok=True)
    for cycle in range(2):
        steps = range(cycle * STEPS, (cycle + 1) * STEPS)
        slow = {s: SLOW for s in steps} if cycle == slow_in else {}
        for rank in ranks:
            data = kineto_cycle_file(rank, WORLD, steps, slow)
            (folder / f"host_{4000 + rank}.{1700000000 + cycle}.pt.trace.json").write_text(
                json.dumps(data))
    return folder


def test_two_cycles_are_each_judged_by_default(tmp_path: Path) -> None:
    folder = two_cycles(tmp_path / "prof")
    done = run_cli("detect", str(folder))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "cycle 1 of 2 (profiler steps 0-4):" and lines[1].startswith("healthy")
    assert "cycle 2 of 2 (profiler steps 5-9):" in lines
    assert lines[lines.index("cycle 2 of 2 (profiler steps 5-9):") + 1].startswith(
        "root cause: rank 1 (compute")
    report = json.loads(run_cli("detect", str(folder), "--json").stdout)
    assert [(c["cycle"], c["steps"], c["healthy"]) for c in report["cycles"]] == [
        (1, [0, 4], True), (2, [5, 9], False)]


def test_one_cycle_or_all_merged_on_request(tmp_path: Path) -> None:
    folder = two_cycles(tmp_path / "prof")
    second = json.loads(run_cli("detect", str(folder), "--cycle", "2", "--json").stdout)
    assert [(c["rank"], c["kind"]) for c in second["root_causes"]] == [(1, "compute")]
    first = json.loads(run_cli("detect", str(folder), "--cycle", "1", "--json").stdout)
    assert first["healthy"]
    merged = json.loads(run_cli("analyze", str(folder), "--cycle", "all", "--json").stdout)
    assert len(merged["iteration_times_s"]) == 2 * STEPS
    each = json.loads(run_cli("analyze", str(folder), "--json").stdout)
    assert [len(c["iteration_times_s"]) for c in each["cycles"]] == [STEPS, STEPS]


def test_a_cycle_the_folder_lacks_is_one_line(tmp_path: Path) -> None:
    done = run_cli("detect", str(two_cycles(tmp_path / "prof")), "--cycle", "3")
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert "2 profiling cycles" in line and "--cycle 3" in line


def test_the_same_rank_twice_in_one_cycle_is_refused_saying_what_to_do(tmp_path: Path) -> None:
    folder = two_cycles(tmp_path / "prof")
    shutil.copy(folder / "host_4002.1700000000.pt.trace.json", folder / "rank2-copy.json")
    done = run_cli("detect", str(folder))
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert "rank 2 twice in one profiling cycle" in line and "keep one of the two" in line


def test_missing_ranks_are_named_once_and_in_json(tmp_path: Path) -> None:
    folder = two_cycles(tmp_path / "prof", ranks=range(3))
    done = run_cli("detect", str(folder), "--json")
    assert done.returncode == 0, done.stderr
    (line,) = done.stderr.splitlines()
    assert "3 of the 4 ranks" in line and "missing: 3" in line
    assert json.loads(done.stdout)["missing_ranks"] == [3]


def test_cycles_are_grouped_by_time_one_file_per_rank() -> None:
    files = [FileWindow("a", 0, 0, 10), FileWindow("b", 1, 1, 11), FileWindow("c", 0, 50, 60),
             FileWindow("d", 1, 52, 61), FileWindow("e", 2, 53, 58)]
    assert group_cycles(files) == [[0, 1], [2, 3, 4]]
    with pytest.raises(TraceError, match="rank 0 twice"):
        group_cycles([*files, FileWindow("f", 0, 55, 56)])
    assert rank_ranges([7, 0, 1, 2, 5, 8]) == "0-2, 5, 7-8"


# ------------------------------------------------------------------ GPU time
def kernel(start: float, dur: float, stream: int, kind: str = "compute",
           iteration: int | None = None) -> Event:
    args = {"stream": stream, "kind": kind, **({} if iteration is None else
                                              {"iteration": iteration})}
    return Event("k", start, dur, args)


def test_gpu_time_is_a_union_over_streams() -> None:
    """Two compute streams overlap, an all-reduce runs half under compute:
    busy is the union, idle the window less it, never negative."""
    events = [kernel(0.0, 4.0, 7), kernel(1.0, 4.0, 8), kernel(4.0, 2.0, 20, "collective"),
              kernel(9.0, 1.0, 7), kernel(7.0, 0.5, 9, "other"),
              Event("ProfilerStep#1", 0.0, 20.0, {"kind": "other"})]  # no stream: not GPU work
    t = rank_gpu_time(events)
    assert t is not None
    assert (t.window_s, t.compute_s, t.comm_s, t.memory_s) == (10.0, 6.0, 2.0, 0.5)
    assert (t.overlap_s, t.busy_s, t.idle_s) == (1.0, 7.5, 2.5)
    assert sum(e.dur_s for e in events[:5]) > t.window_s  # the sum would overflow it


def test_an_iteration_s_window_runs_to_the_next_one_s_first_kernel() -> None:
    events = [kernel(0.0, 1.0, 7, iteration=1), kernel(0.5, 1.0, 8, iteration=1),
              kernel(3.0, 1.0, 7, iteration=2), kernel(1.8, 0.4, 7, iteration=1)]
    per = iteration_gpu_times(events)
    assert per[1].window_s == 3.0 and per[1].busy_s == pytest.approx(1.9)
    assert per[2].window_s == 1.0 and per[2].idle_s == 0.0


# ------------------------------------------------- outputs beside the traces
def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


@pytest.fixture
def read_only_traces(tmp_path: Path):
    folder = tmp_path / "prof"
    shutil.copytree(PUBLIC / "sampled_128", folder)
    for p in [*folder.iterdir(), folder]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    yield folder
    for p in [folder, *folder.iterdir()]:
        p.chmod(p.stat().st_mode | stat.S_IWUSR)


def test_commands_never_write_into_a_read_only_trace_folder(read_only_traces: Path) -> None:
    """(Run as root, the folder is writable whatever its mode: nothing may
    appear in it either way.)"""
    before = _snapshot(read_only_traces)
    out = read_only_traces.parent / "prof-megascan"
    for command in (["align"], ["plot"], ["report"]):
        for _again in range(2):  # a second run replaces what the first wrote
            done = run_cli(*command, str(read_only_traces))
            assert done.returncode == 0, (command, done.stderr)
    assert _snapshot(read_only_traces) == before
    assert {"aligned_trace.json", "timeline.png", "report.html"} <= {p.name for p in
                                                                   out.iterdir()}
