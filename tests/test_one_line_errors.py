"""Inputs that used to end in a traceback: each is one line on stderr naming
the field (or the file and the field), exit 2, and nothing written."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from megatronapp.scope.view import analyses
from megatronapp.errors import UserError

from .support import ROOT, one_line_error, run_cli

TRACE_COMMANDS = [["detect"], ["analyze"], ["align", "--out", "{tmp}/a.json"],
                  ["query", "SELECT count(*) FROM events"], ["plot"],
                  ["export-trace", "--out", "{tmp}/e.json"], ["watch", "--idle", "1"],
                  ["report", "--out", "{tmp}/r.html"]]


def one_line(result: subprocess.CompletedProcess[str], *words: str) -> str:
    line = one_line_error(result, *words)
    assert "Traceback" not in result.stderr
    return line


def _command(words: list[str], target: Path, tmp: Path) -> list[str]:
    head, *rest = words
    if head == "query":
        return [head, str(target), *rest]
    return [head, str(target), *(w.format(tmp=tmp) for w in rest)]


@pytest.fixture
def run(throttle_run: Path) -> Path:
    return throttle_run  # read only: the tests copy it before changing it


def _with_metadata(run: Path, tmp: Path, meta: bytes) -> Path:
    copy = tmp / "bad"
    shutil.copytree(run, copy)
    table = pq.read_table(copy / "trace.parquet")
    pq.write_table(table.replace_schema_metadata({b"megatronapp": meta}), copy / "trace.parquet")
    return copy


def _nan_clock(run: Path) -> bytes:
    meta = json.loads(pq.read_schema(run / "trace.parquet").metadata[b"megatronapp"])
    meta["clocks"] = {"1": [float("nan"), 0.0]}
    return json.dumps(meta).encode()


@pytest.mark.parametrize("command", TRACE_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("meta", ["not json", "a list", "nan clock"])
def test_a_store_with_malformed_metadata(run, tmp_path, command, meta):
    raw = {"not json": b"{format: 1", "a list": b"[1, 2]", "nan clock": _nan_clock(run)}[meta]
    bad = _with_metadata(run, tmp_path, raw)
    line = one_line(run_cli(*_command(command, bad, tmp_path)), "trace.parquet")
    if meta == "nan clock":
        assert "clocks: rank 1" in line and "finite" in line


LONG = "x" * 300


@pytest.mark.parametrize("argv", [
    ["run", f"{LONG}.yaml"], ["predict", f"{LONG}.yaml"], ["detect", LONG], ["analyze", LONG],
    ["query", LONG, "SELECT 1"], ["align", LONG], ["plot", LONG], ["export-trace", LONG],
    ["report", LONG], ["watch", LONG], ["sweep", f"{LONG}.yaml"], ["calibrate", LONG,
                                                                     "--scenario", "s.yaml"],
    ["scope", "summary", LONG], ["scope", "query", LONG, "SELECT 1"], ["scope", "serve", LONG],
    ["scope", "generate", LONG, "--prompt", "a"], ["scope", "lens", LONG, "--prompt", "a"],
    ["run", str(ROOT / "scenarios/throttle.yaml"), "--out", f"runs/{LONG}"],
    ["validate-detector", "--replay", LONG], ["dpp", "windows", f"{LONG}.yaml"]],
    ids=lambda a: " ".join(a[:2])[:30])
def test_a_name_longer_than_the_file_system_takes(argv, tmp_path):
    result = run_cli(*argv, cwd=tmp_path)
    one_line(result)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ watch
def _kineto(folder: Path, rank: object, world: object) -> None:
    folder.mkdir(exist_ok=True)
    data = {"schemaVersion": 1, "traceEvents": [], "baseTimeNanoseconds": 0,
            "distributedInfo": {"rank": rank, "world_size": world}}
    (folder / f"r{rank!s:.8}.pt.trace.json").write_text(json.dumps(data))


@pytest.mark.parametrize("rank, world, field", [([0], 2, "rank"), ("0", 2, "rank"),
                                                (0, "two", "world_size"), (0, 2.5, "world_size"),
                                                (3, 2, "rank 3"), (0, True, "world_size")])
def test_watch_names_a_rank_or_world_size_of_the_wrong_type(tmp_path, rank, world, field):
    _kineto(tmp_path / "job", rank, world)
    one_line(run_cli("watch", str(tmp_path / "job"), "--idle", "2", "--interval", "0.1"),
             "distributedInfo", field)


def test_watch_interval_too_long_for_sleep():
    one_line(run_cli("watch", ".", "--interval", "1e10"), "--interval")


# ------------------------------------------------------------------ report
def test_report_on_a_schema_valid_summary_with_nulls(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    summary = json.loads((copy / "summary.json").read_text())
    summary["iteration_times_s"] = [None] * len(summary["iteration_times_s"])
    summary["bubble_fraction"] = None
    (copy / "summary.json").write_text(json.dumps(summary))
    done = run_cli("report", str(copy), "--out", str(tmp_path / "r.html"))
    assert done.returncode == 0, done.stderr
    assert "iteration time" in (tmp_path / "r.html").read_text()


# ------------------------------------------------------------------ captures
@pytest.fixture
def capture(tmp_path: Path) -> Path:
    from megatronapp.scope.storage import PartWriter, merge_capture

    PartWriter(tmp_path / "cap", 0).close(dropped=0)
    merge_capture(tmp_path / "cap", {"source": "test"})
    return tmp_path / "cap"


@pytest.mark.parametrize("file, content, words", [
    ("manifest.json", "[" * 100_000 + "]" * 100_000, ["not a MegaScope capture"]),
    ("manifest.json", '{"format": "megascope-capture", "files": 3}', ["'files'"]),
    ("raw.json", "[" * 100_000 + "]" * 100_000, ["raw.json", "nested too deeply"]),
    ("raw.json", '{"a": 1}', ["raw.json", "list of objects"]),
    ("injections.json", "[1, 2]", ["injections.json", "list of objects"])])
def test_capture_files_nested_deep_or_malformed(capture, file, content, words):
    (capture / file).write_text(content)
    one_line(run_cli("scope", "query", str(capture), "SELECT count(*) FROM stats"), *words)


# ------------------------------------------------------------------ sweeps
@pytest.mark.parametrize("body, words", [
    (b"", ["SPEC", "got nothing"]),
    (b"scenario: throttle.yaml\nseeds: .nan\n", ["seeds"]),
    (b"scenario: throttle.yaml\nseeds: \xff\n", ["not UTF-8"]),
    (("scenario: throttle.yaml\ngrid: " + "[" * 200 + "]" * 200).encode(), ["nested"]),
    (b"[1, 2]", ["mapping"]),
    (b"scenario: throttle.yaml\nseeds: 0\n", ["makes no runs"])],
    ids=["empty", "nan", "not utf-8", "deep", "a list", "no runs"])
def test_a_sweep_spec_that_is_not_one(tmp_path, body, words):
    shutil.copy(ROOT / "scenarios/throttle.yaml", tmp_path / "throttle.yaml")
    (tmp_path / "s.yaml").write_bytes(body)
    one_line(run_cli("sweep", "s.yaml", "--out", "t.parquet", cwd=tmp_path), *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml", "throttle.yaml"]


def test_a_grid_over_mappings_makes_its_report(tmp_path):
    shutil.copy(ROOT / "scenarios/throttle.yaml", tmp_path / "throttle.yaml")
    faults = [{"kind": "throttle", "rank": r, "factor": 1.5} for r in (1, 2)]
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({"scenario": "throttle.yaml",
                                                     "grid": {"faults.0": faults}}))
    done = run_cli("sweep", "s.yaml", "--out", "t.parquet", "--report", "r.html", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "r.html").read_text()
    assert '&quot;rank&quot;: 1' in page and '&quot;rank&quot;: 2' in page


# ------------------------------------------------------------------ scope generate
@pytest.mark.parametrize("argv, words", [
    (["--observe", "[" * 100 + "]" * 100], ["--observe", "nested"]),
    (["--temperature", "nan"], ["--temperature", "finite"]),
    (["--temperature", "-1"], ["--temperature", ">= 0"])])
def test_scope_generate_refuses_before_it_loads(tmp_path, argv, words):
    one_line(run_cli("scope", "generate", str(tmp_path / "ckpt"), "--prompt", "a",
                     "--out", str(tmp_path / "out"), *argv), *words)
    assert list(tmp_path.iterdir()) == []


def test_a_patching_result_of_the_wrong_shape_is_one_line(tmp_path):
    bad = {"analysis": "patch", "clean": "ab", "corrupt": "ac", "tokens": ["a", "c"],
           "answers": ["x", "y"], "sites": ["resid_pre", "attn.out"], "layers": [1, 2],
           "restored": [[[0.5, 0.5], [0.5, 0.5]]]}  # one site's maps for two sites
    path = tmp_path / "patch-0123456789ab.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(UserError, match="restored: .*one per site expected, got 1 for 2"):
        analyses.read(path)
