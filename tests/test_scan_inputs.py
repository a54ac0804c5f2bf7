"""Trace and run-directory inputs: every malformed input is one line naming
the file (and the event), never a traceback, a wrong answer or a partial file."""
from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatronapp.cli import main
from megatronapp.scenario.config import parse_scenario
from megatronapp.run.write import write_run
from megatronapp.scan.ingest.load import TraceError, events_from_chrome
from sim import run_sim

from .support import ROOT

SCENARIO = {"name": "scan", "seed": 3, "parallel": {"tp": 2, "pp": 2, "microbatches": 2},
            "model": {"layers": 4, "hidden": 64, "heads": 2, "seq_len": 64, "vocab": 128},
            "faults": [{"kind": "clock_skew", "rank": 1, "offset_us": 50}]}
COMMANDS = (["analyze"], ["detect"], ["query", "SELECT count(*) FROM events"], ["align"])


@pytest.fixture(scope="module")
def good_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    s = parse_scenario(SCENARIO)
    out = tmp_path_factory.mktemp("scan") / "run"
    out.mkdir()
    write_run(s, run_sim(s), out)
    return out


@pytest.fixture
def run_dir(good_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(good_run, copy)
    return copy


def _one_line(capsys, argv: list[str], *words: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert all(w in err[0] for w in words), err[0]
    return err[0]


def _x(**fields) -> dict:
    return {"ph": "X", "name": "forward", "pid": 0, "tid": 0, "ts": 0, "dur": 1, **fields}


@pytest.mark.parametrize("event,words", [
    (_x(ts=float("nan")), ["'ts' must be a finite number", "event 1"]),
    (_x(dur=float("inf")), ["'dur' must be a finite number", "event 1"]),
    ({"name": "forward", "pid": 0, "ts": 0, "dur": 1}, ["'ph'", "event 1"]),
    (_x(name="dp_allreduce", args={"group": ["a", "b"]}), ["args.group", "event 1"]),
    (_x(name="dp_allreduce", args={"group": {"r": 1}}), ["args.group", "event 1"]),
    (_x(name="send_forward", args={"peer": "1"}), ["args.peer", "event 1"]),
    (_x(args={"iteration": True}), ["args.iteration"]),
    (_x(args={"bytes": -1}), ["args.bytes"]),
])
@pytest.mark.parametrize("command", COMMANDS)
def test_bad_events_name_the_file_and_the_event(capsys, tmp_path, event, words, command):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [_x(), event]}))  # NaN/Infinity as JSON allows
    _one_line(capsys, [command[0], str(trace), *command[1:]], "t.json", *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


@pytest.mark.parametrize("data", [[], {"traceEvents": []},
                                  {"traceEvents": [{"ph": "M", "name": "process_name", "pid": 0}]}])
@pytest.mark.parametrize("command", COMMANDS)
def test_an_empty_trace_is_an_error_not_healthy(capsys, tmp_path, data, command):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(data))
    _one_line(capsys, [command[0], str(trace), *command[1:]], "t.json", "no events")


@pytest.mark.parametrize("content,words", [
    (("[" * 100_000 + "]" * 100_000).encode(), ["nested too deeply"]),
    (bytes(range(256)) * 4, ["not UTF-8"]),
    (json.dumps({"traceEvents": [_x()]}).encode("utf-16"), ["UTF-16"]),
    (b"\x1f\x8b\x08\x00binarygzip", ["not UTF-8"]),
])
@pytest.mark.parametrize("command", COMMANDS)
def test_undecodable_trace_files_are_one_line(capsys, tmp_path, content, words, command):
    trace = tmp_path / "t.json"
    trace.write_bytes(content)
    _one_line(capsys, [command[0], str(trace), *command[1:]], "t.json", *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


def test_a_deeply_nested_args_object_is_refused():
    deep: dict = {}
    for _ in range(100):
        deep = {"x": deep}
    with pytest.raises(TraceError, match="nested"):
        events_from_chrome([_x(args=deep)], "t.json")


@pytest.mark.parametrize("name,content,command", [
    ("summary.json", "{broken", ["analyze"]),
    ("summary.json", "[1, 2]", ["detect"]),
    ("summary.json", '{"scenario": {"cluster": {"gpus_per_node": "eight"}}}', ["detect"]),
    ("summary.json", '{"scenario": []}', ["query", "SELECT 1"]),
    ("ground_truth.json", "{broken", ["align"]),
    ("ground_truth.json", '{"clocks": {"1": {"offset_us": "far"}}}', ["align"]),
    ("ground_truth.json", '{"clocks": [1]}', ["align"]),
    ("ground_truth.json", b"\xff\xfe{}", ["align"]),
])
def test_corrupt_side_files_name_that_file(capsys, run_dir, name, content, command):
    path = run_dir / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    _one_line(capsys, [command[0], str(run_dir), *command[1:]], name)
    assert not (run_dir / "aligned_trace.json").exists()


@pytest.mark.parametrize("make_out,words", [
    (lambda tmp: tmp / "missing" / "a.json", ["--out", "missing"]),
    (lambda tmp: tmp, ["--out", "is a directory"]),
    (lambda tmp: Path("/proc/aligned.json"), ["--out", "/proc"]),
])
def test_align_out_that_cannot_be_written_is_one_line(capsys, run_dir, tmp_path, make_out, words):
    out = make_out(tmp_path)
    _one_line(capsys, ["align", str(run_dir), "--out", str(out)], *words)
    leftovers = [p for p in [*tmp_path.rglob("*partial*"), *Path("/proc").glob(".aligned*")]]
    assert leftovers == [] and not (run_dir / "aligned_trace.json").exists()


@pytest.mark.parametrize("make_csv,words", [
    (lambda tmp: tmp, ["--csv", "is a directory"]),
    (lambda tmp: tmp / "file.txt" / "v.csv", ["--csv"]),
])
def test_validate_detector_csv_that_cannot_be_written_is_one_line(capsys, tmp_path, make_csv,
                                                                  words):
    (tmp_path / "file.txt").write_text("not a directory")
    _one_line(capsys, ["validate-detector", "--trials", "1", "--csv", str(make_csv(tmp_path))],
              *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_query_with_empty_sql_is_one_line(capsys, run_dir):
    _one_line(capsys, ["query", str(run_dir), ""], "SQL", "empty")
    _one_line(capsys, ["query", str(run_dir), "  \n "], "SQL", "empty")


def test_plot_of_a_foreign_trace_with_odd_arguments(capsys, tmp_path):
    """Sends to ranks not in the trace and events without our arguments plot."""
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": [
        _x(name="send_forward", args={"peer": 7}), _x(pid=1, name="recv_forward"),
        _x(pid=1, name="backward", ts=5)]}))
    assert main(["plot", str(tmp_path)]) == 0, capsys.readouterr().err
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))


def test_plot_that_fails_half_way_leaves_no_png(run_dir, tmp_path):
    """With a file-size limit some PNGs cannot be written: none may be left.
    (The compiled functions' cache is written first, without the limit, as a
    run before this one would have: its files are larger than the limit.)"""
    warm = shutil.copytree(run_dir, tmp_path / "warm")
    subprocess.run([sys.executable, "-m", "megatronapp.cli", "plot", str(warm)], check=True,
                   capture_output=True, cwd=ROOT, timeout=300)
    result = subprocess.run([sys.executable, "-m", "megatronapp.cli", "plot", str(run_dir)],
                            capture_output=True, text=True, cwd=ROOT, timeout=300,
                            preexec_fn=_limit_file_size)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert sorted(p.name for p in run_dir.iterdir() if p.suffix == ".png" or
                  p.name.startswith(".")) == []
