"""A recorded run cut to its first K profiler steps (``experiments.scan_trace_length``)
reads as a trace of K iterations, each as the whole trace recorded it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from experiments.scan_trace_length import first_steps, main, truncated_run
from megatronapp.scan.align.inputs import load_scan_input

RUN = Path(__file__).resolve().parent / "data" / "heldout16" / "ddp_sync_batchnorm_by_hand-healthy-0"


def _iterations(scan) -> list[int]:
    its = scan.cols.iteration
    return sorted(set(its[its >= 0].tolist()))


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_a_run_cut_to_k_steps_holds_its_first_k_iterations_unchanged(steps: int,
                                                                     tmp_path: Path) -> None:
    whole = load_scan_input(RUN)
    cut = load_scan_input(truncated_run(RUN, steps, tmp_path / "cut"))
    assert _iterations(cut) == _iterations(whole)[:steps]
    for rank in range(4):
        def durations(scan, rank=rank):
            keep = (scan.cols.rank == rank) & np.isin(scan.cols.iteration, _iterations(cut))
            return sorted(np.round(scan.cols.dur_s[keep], 9).tolist())
        assert durations(cut) == durations(whole)


def test_asking_for_more_steps_than_traced_keeps_the_trace_whole() -> None:
    trace = {"traceEvents": [{"ph": "X", "name": "ProfilerStep#2", "ts": 0, "dur": 10},
                             {"ph": "X", "name": "aten::mm", "ts": 5, "dur": 1},
                             {"ph": "M", "name": "process_name"}]}
    assert first_steps(trace, 1) == trace
    assert first_steps(trace, 5) == trace
    two = {"traceEvents": trace["traceEvents"] + [
        {"ph": "X", "name": "ProfilerStep#3", "ts": 30, "dur": 10}]}
    # the metadata event has no time and stays; the second step goes
    assert [e["name"] for e in first_steps(two, 1)["traceEvents"]] == [
        "ProfilerStep#2", "aten::mm", "process_name"]


def test_bad_arguments_exit_2_naming_them(tmp_path: Path, capsys) -> None:
    assert main([str(tmp_path)]) == 2
    assert "manifest.json" in capsys.readouterr().err
    assert main([str(RUN.parent), str(tmp_path)]) == 2  # every set is checked before any work
    assert main([str(RUN.parent), "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err
