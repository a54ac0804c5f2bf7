"""Output directories that cannot destroy anything (``megatronapp run --out``)."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from megatronapp.cli import main
from megatronapp.errors import UserError
from megatronapp.io.outdirs import MANIFEST, clean_leftovers, read_manifest, staged_dir

from .support import ROOT, dead_pid, mark_as_ours

TINY = ("name: tiny\nparallel: {pp: 2, microbatches: 2}\n"
        "model: {layers: 2, hidden: 64, heads: 2, seq_len: 64, vocab: 128}\n")


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    code = main(["run", *argv, "--quiet"])
    return code, capsys.readouterr().err.strip().splitlines()


def _listing(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_a_directory_of_user_files_is_refused_and_kept(tmp_path, scenario, capsys):
    users = tmp_path / "userdata"
    users.mkdir()
    (users / "thesis.tex").write_text("years of work")
    code, err = _run(capsys, str(scenario), "--out", str(users))
    assert code == 2 and len(err) == 1 and "--out" in err[0] and "not a megatronapp result" in err[0]
    assert _listing(users) == {"thesis.tex": b"years of work"}
    code, err = _run(capsys, str(scenario), "--out", str(users), "--force")
    assert code == 2 and len(err) == 1 and _listing(users) == {"thesis.tex": b"years of work"}


@pytest.mark.parametrize("out", [".", "sub/..", "sub/../..", "/"])
def test_the_current_directory_and_its_parents_are_refused(tmp_path, scenario, capsys,
                                                           monkeypatch, out):
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    before = _listing(tmp_path)
    code, err = _run(capsys, "tiny.yaml", "--out", out)
    assert code == 2 and len(err) == 1 and "current directory" in err[0]
    assert _listing(tmp_path) == before


def test_the_scenario_files_directory_is_refused(tmp_path, capsys, monkeypatch):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "tiny.yaml").write_text(TINY)
    work = tmp_path / "elsewhere"
    work.mkdir()
    monkeypatch.chdir(work)
    code, err = _run(capsys, str(inputs / "tiny.yaml"), "--out", str(inputs))
    assert code == 2 and len(err) == 1 and "tiny.yaml" in err[0]
    assert _listing(inputs) == {"tiny.yaml": TINY.encode()}


@pytest.mark.parametrize("name", ["../victim", "/tmp/victim", "''", ".", "..", "a/b", ".hidden"])
def test_unsafe_names_are_refused_naming_name(tmp_path, scenario, capsys, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "keep.txt").write_text("mine")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "other").mkdir()
    before = _listing(tmp_path)
    code, err = _run(capsys, str(scenario), "--set", f"name={name}")
    assert code == 2 and len(err) == 1 and "name:" in err[0]
    assert _listing(tmp_path) == before and (tmp_path / "runs" / "other").is_dir()


def test_a_previous_result_is_replaced_only_with_force(tmp_path, scenario, capsys):
    out = tmp_path / "result"
    assert _run(capsys, str(scenario), "--out", str(out))[0] == 0
    manifest = read_manifest(out)
    assert manifest is not None
    assert set(manifest.files) == set(_listing(out)) - {MANIFEST}
    assert {"summary.json", "trace.json", "trace.parquet", "ground_truth.json"} <= set(
        manifest.files)
    first = _listing(out)
    code, err = _run(capsys, str(scenario), "--out", str(out), "--set", "seed=5")
    assert code == 2 and len(err) == 1 and "--force" in err[0] and _listing(out) == first
    assert main(["plot", str(out)]) == 0  # plots join the result's manifest
    assert main(["export-trace", str(out), "--ranks", "1"]) == 0  # so do exports
    assert {"timeline.png", "trace-ranks1_all-it.json"} <= set(
        read_manifest(out).added)  # type: ignore[union-attr]
    code, err = _run(capsys, str(scenario), "--out", str(out), "--force",
                     "--set", "parallel.pp=1", "--set", "model.layers=2")
    assert code == 0, err
    after = _listing(out)
    assert "timeline.png" not in after and "trace-ranks1_all-it.json" not in after  # they went
    assert json.loads(after["summary.json"])["world_size"] == 1


def test_force_refuses_a_result_holding_foreign_files(tmp_path, scenario, capsys):
    out = tmp_path / "result"
    assert _run(capsys, str(scenario), "--out", str(out))[0] == 0
    (out / "notes").mkdir()
    (out / "notes" / "notes.txt").write_text("mine")
    before = _listing(out)
    code, err = _run(capsys, str(scenario), "--out", str(out), "--force")
    assert code == 2 and len(err) == 1 and "notes/" in err[0]
    assert _listing(out) == before


def test_a_manifest_listing_paths_outside_is_not_a_result(tmp_path, scenario, capsys):
    out = tmp_path / "result"
    out.mkdir()
    (tmp_path / "precious").write_text("keep")
    (out / MANIFEST).write_text(json.dumps({"kind": "megatronapp result",
                                            "files": ["../precious"]}))
    assert read_manifest(out) is None
    code, err = _run(capsys, str(scenario), "--out", str(out), "--force")
    assert code == 2 and len(err) == 1 and (tmp_path / "precious").read_text() == "keep"


def test_two_runs_finishing_into_one_directory(tmp_path):
    out = tmp_path / "shared"
    with pytest.raises(UserError, match="appeared while this run was writing"):
        with staged_dir(out) as first:
            (first / "summary.json").write_text("{}")
            with staged_dir(out) as second:  # finishes first
                (second / "summary.json").write_text('{"second": 1}')
    assert json.loads((out / "summary.json").read_text()) == {"second": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared"]  # no staging left


def test_an_exception_while_staging_removes_the_staging_directory(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        with staged_dir(out) as tmp:
            (tmp / "ranks").mkdir()
            (tmp / "ranks" / "rank0.json").write_text("[")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_leftovers_of_killed_runs_are_cleaned_and_nothing_else(tmp_path, scenario, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    dead = dead_pid()
    killed = runs / f".tiny.partial-{dead}"
    (killed / "ranks").mkdir(parents=True)
    mark_as_ours(killed, dead, "tiny")
    (killed / "ranks" / "rank0.json").write_text("[half")
    foreign = runs / f".notes.partial-{dead}"  # looks like ours, has no marker: not ours
    foreign.mkdir()
    (foreign / "draft.txt").write_text("mine")
    live = runs / f".other.partial-{os.getppid()}"  # a running process: leave it
    live.mkdir()
    mark_as_ours(live, os.getppid(), "other")
    assert _run(capsys, str(scenario), "--out", str(runs / "tiny"))[0] == 0
    assert not killed.exists() and (foreign / "draft.txt").read_text() == "mine" and live.exists()
    assert clean_leftovers(runs) == []


def _limit_file_size(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, scenario):
    """A file-size limit makes writes fail as a full disk does (an OSError)."""
    out = tmp_path / "result"
    result = subprocess.run([sys.executable, "-m", "megatronapp.cli", "run", str(scenario),
                             "--out", str(out), "--quiet", "--set", "parallel.microbatches=64"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300,
                            preexec_fn=_limit_file_size(4096))
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "--out" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.yaml"]
