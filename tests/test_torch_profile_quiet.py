"""``--profile`` adds a trace, not noise: Kineto's start/stop marker lines
never reach the user's terminal, anything else written meanwhile still does."""
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from backends.torch.profile import kineto_markers_dropped, kineto_profile  # noqa: E402


def test_a_profiled_block_writes_its_trace_and_no_kineto_marker_lines(tmp_path: Path,
                                                                      capfd) -> None:
    with kineto_profile(str(tmp_path), rank=3):
        torch.ones(8) @ torch.ones(8)
    err = capfd.readouterr().err
    assert "USDT:" not in err and "STAGE:" not in err, err
    assert (tmp_path / "rank3.pt.trace.json.gz").stat().st_size > 0


def test_other_lines_written_while_markers_are_dropped_still_reach_stderr(capfd) -> None:
    with kineto_markers_dropped():
        os.write(2, b"USDT:2026 x.cpp:52] profiler_start\n")
        os.write(2, b"a real warning\n")
    assert capfd.readouterr().err == "a real warning\n"
