"""End to end through the console entry point's main (in process)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatronapp.scan.ingest.load import read_events

from .support import ROOT, run_cli


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "throttle"
    result = run_cli("run", str(ROOT / "scenarios" / "throttle.yaml"), "--out", str(out),
                     "--set", "iterations=2")
    assert result.returncode == 0, result.stderr
    assert "bubble fraction" in result.stdout and "throttle" in result.stdout
    return out


def test_run_writes_summary(run_dir: Path) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["backend"] == "sim" and summary["world_size"] == 16
    assert len(summary["iteration_times_s"]) == 2
    assert all(t > 0 for t in summary["iteration_times_s"])
    assert 0 < summary["bubble_fraction"] < 1
    assert summary["faults"][0] == {"kind": "throttle", "rank": 5, "factor": 1.5,
                                    "start_s": 0.02, "end_s": None}
    assert summary["scenario"]["iterations"] == 2  # the resolved scenario, --set applied


def test_trace_is_chrome_format_one_process_per_rank(run_dir: Path) -> None:
    data = json.loads((run_dir / "trace.json").read_text())
    events = data["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names[6] == "rank 6 (dp 1, pp 1, tp 0)"
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in complete} == set(range(16))
    assert all(e["dur"] >= 0 and isinstance(e["ts"], float | int) for e in complete)
    fwd = next(e for e in complete if e["name"] == "forward")
    assert {"iteration", "microbatch", "chunk"} <= fwd["args"].keys()
    coll = next(e for e in complete if e["name"] == "dp_allreduce")
    assert coll["args"]["group"] == [coll["pid"] - 2, coll["pid"]] or coll["pid"] in coll["args"]["group"]
    p2p = next(e for e in complete if e["name"] == "send_forward")
    assert {"bytes", "peer"} <= p2p["args"].keys()


def test_a_local_clock_export_keeps_each_ranks_clock(run_dir: Path) -> None:
    merged = read_events(run_dir / "trace.json")
    truth = json.loads((run_dir / "ground_truth.json").read_text())["clocks"]
    local = run_dir / "local.json"
    result = run_cli("export-trace", str(run_dir), "--ranks", "0,9", "--clock", "local",
                     "--out", str(local))
    assert result.returncode == 0, result.stderr
    exported = read_events(local)
    assert sorted(exported) == [0, 9]
    for rank in (0, 9):
        raw = exported[rank]
        clock = truth[str(rank)]
        for local, true in zip(raw[:50], merged[rank][:50]):
            expected = true.start_s * (1 + clock["drift_ppm"] * 1e-6) + clock["offset_us"] * 1e-6
            assert local.start_s == pytest.approx(expected, abs=2e-9)
    assert truth["9"]["offset_us"] == 1500.0


@pytest.mark.slow
def test_plot_writes_png(run_dir: Path) -> None:
    result = run_cli("plot", str(run_dir))
    assert result.returncode == 0, result.stderr
    png = run_dir / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_missing_run_is_a_one_line_error(tmp_path: Path) -> None:
    result = run_cli("plot", str(tmp_path / "nothing"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1


def test_unknown_backend_is_rejected(tmp_path: Path) -> None:
    result = run_cli("run", str(ROOT / "scenarios" / "throttle.yaml"), "--backend", "tpu",
                     "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and "--backend" in result.stderr
    assert not (tmp_path / "o").exists()


def test_simulated_deadlock_is_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import sim.run
    from megatronapp.cli import main
    from megatronapp.parallel.ops import Recv

    def receive_first(rank: int):
        yield Recv(src=1 - rank, tag="x", nbytes=4)

    def both_receive_first(s, stages_for=None):
        return {r: receive_first(r) for r in range(2)}

    monkeypatch.setattr(sim.run, "rank_programs", both_receive_first)
    out = tmp_path / "o"
    code = main(["run", str(ROOT / "scenarios" / "throttle.yaml"), "--out", str(out), "--quiet",
                 "--set", "parallel={tp: 1, pp: 1, dp: 2}", "--set", "faults=[]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "rank 0 on Recv(src=1" in err[0] and "rank 1 on Recv(src=0" in err[0]
    assert not out.exists()


@pytest.mark.parametrize("make_out", [
    lambda tmp: (tmp / "a_file").write_text("x") and tmp / "a_file",
    lambda tmp: (tmp / "blocker").write_text("x") and tmp / "blocker" / "run",
])
def test_unusable_out_dir_is_rejected_before_running(tmp_path: Path, make_out) -> None:
    out = make_out(tmp_path)
    result = run_cli("run", str(ROOT / "scenarios" / "throttle.yaml"), "--out", str(out))
    assert result.returncode == 2 and "--out" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_plot_of_corrupt_trace_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "trace.json").write_text("{not json")
    result = run_cli("plot", str(tmp_path))
    assert result.returncode == 2 and "not valid JSON" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "timeline.png").exists()
