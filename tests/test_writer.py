"""The one writer: what a user has is never lost, whichever command writes.

Each test runs the real command line in a subprocess (or, where a failure must
be made to happen part-way, ``main`` in this process) and checks the exit
status, the one line on stderr, and every user file byte for byte."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatronapp.cli import main
from megatronapp.io.outdirs import MANIFEST, STAGING_MARKER, read_manifest

from .support import ROOT, dead_pid, mark_as_ours

TINY = ("name: tiny\nparallel: {pp: 2, microbatches: 2}\n"
        "model: {layers: 2, hidden: 64, heads: 2, seq_len: 64, vocab: 128}\n")
SWEEP = "scenario: tiny.yaml\nseeds: [1, 2]\n"


def cli(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "megatronapp.cli", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def tree(root: Path) -> dict[str, str]:
    """Every file (its SHA-256) and folder under ``root``, hidden ones included."""
    found = {}
    for parent, dirs, files in os.walk(root):
        for name in dirs:
            found[os.path.relpath(os.path.join(parent, name), root)] = "dir"
        for name in files:
            path = Path(parent) / name
            found[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def one_line_error(proc: subprocess.CompletedProcess[str], *words: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and all(w in lines[0] for w in words), lines[0]
    return lines[0]


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "tiny.yaml").write_text(TINY)
    return tmp_path


@pytest.fixture
def result(work: Path) -> Path:
    proc = cli(work, "run", "tiny.yaml", "--out", "r", "--quiet")
    assert proc.returncode == 0, proc.stderr
    return work / "r"




# ------------------------------------------------ case 1: --force and user folders
@pytest.mark.parametrize("folder", ["notes", "private"])
def test_force_keeps_a_result_holding_a_user_folder(work, result, folder):
    (result / folder).mkdir()
    (result / folder).chmod(0o000 if folder == "private" else 0o755)
    before = tree(work)
    proc = cli(work, "run", "tiny.yaml", "--out", "r", "--force", "--quiet")
    (result / folder).chmod(0o755)
    one_line_error(proc, "--out", f"{folder}/", "did not write")
    assert tree(work) == before


def test_force_replaces_a_result_holding_a_killed_plots_leftovers(work, result):
    leftover = result / f".outputs.partial-{dead_pid()}.abcd1234"
    (leftover / "r").mkdir(parents=True)
    mark_as_ours(leftover, dead_pid(), "outputs")
    (leftover / "r" / "timeline.png").write_bytes(b"half a png")
    proc = cli(work, "run", "tiny.yaml", "--out", "r", "--force", "--quiet", "--set", "seed=3")
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(result)) == sorted([*read_manifest(result).files, MANIFEST])
    assert sorted(os.listdir(work)) == ["r", "tiny.yaml"]  # no staging or trash left


# -------------------------------- case 2: a failure part-way through --force
@pytest.mark.parametrize("failure,status,words", [
    (PermissionError(13, "Permission denied"), 2, "permission denied"),
    (KeyboardInterrupt(), 128 + 2, "interrupt"),
])
def test_a_publish_that_fails_under_force_leaves_the_old_result(work, result, monkeypatch,
                                                                capsys, failure, status, words):
    """The final rename fails (as a read-only folder or a full disk make it),
    or Ctrl-C comes just then: the previous result is back, byte for byte."""
    before = tree(work)
    real_rename = os.rename

    def failing(src, dst, *a, **kw):
        if Path(dst) == Path("r") and ".partial-" in str(src):
            raise failure
        return real_rename(src, dst, *a, **kw)

    monkeypatch.chdir(work)
    monkeypatch.setattr(os, "rename", failing)
    code = main(["run", "tiny.yaml", "--out", "r", "--force", "--quiet", "--set", "seed=9"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == status and len(err) == 1 and words in err[0].lower(), err
    assert tree(work) == before


def test_the_next_command_puts_back_what_a_killed_force_had_set_aside(work, result):
    """Killed between moving the old result aside and putting the new one in
    place: the old result waits in a marked trash folder and comes back."""
    before = tree(result)
    trash = work / ".r.trash-1.abcd1234"
    trash.mkdir()
    mark_as_ours(trash, dead_pid(), "r", use="trash")
    os.rename(result, trash / "old")
    proc = cli(work, "run", "tiny.yaml", "--out", "other", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert tree(result) == before and sorted(os.listdir(work)) == ["other", "r", "tiny.yaml"]


# --------------------------------------- case 3: cleaning never touches user files
def test_leftover_cleaning_keeps_an_unmarked_folder_with_a_manifest(work):
    notes = work / "p" / ".notes.partial-999999"
    notes.mkdir(parents=True)
    (notes / "thesis.tex").write_text("years of work")
    (notes / MANIFEST).write_text(json.dumps({"kind": "megatronapp result", "files": []}))
    before = tree(work / "p")
    proc = cli(work, "run", "tiny.yaml", "--out", "p/res", "--quiet")
    assert proc.returncode == 0, proc.stderr
    after = tree(work / "p")
    assert {k: v for k, v in after.items() if not k.startswith("res")} == before


# ------------------------------------------------- case 4: files in a result
@pytest.mark.parametrize("name", ["trace.parquet", MANIFEST, "summary.json"])
def test_export_never_writes_over_the_runs_own_files(work, result, name):
    before = tree(work)
    proc = cli(work, "export-trace", "r", "--out", f"r/{name}", "--force")
    one_line_error(proc, "--out", name)
    assert tree(work) == before


def test_a_file_deep_in_a_result_is_the_results_even_with_force(tmp_path):
    """A torch run's ``profile/rank0.pt.trace.json.gz``: the manifest of the
    folder above protects it, and a file added there joins that manifest."""
    from megatronapp.errors import UserError
    from megatronapp.io.outdirs import check_file, new_file

    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "rank0.json").write_text("the run's own")
    (tmp_path / MANIFEST).write_text(json.dumps({"kind": "megatronapp result",
                                                 "files": ["profile/rank0.json"]}))
    with pytest.raises(UserError, match="part of the result"):
        check_file(tmp_path / "profile" / "rank0.json", "--out", force=True)
    with new_file(tmp_path / "profile" / "aligned.json", "--out") as tmp:
        tmp.write_text("added")
    assert read_manifest(tmp_path).added == ("profile/aligned.json",)


def test_plot_keeps_a_users_file_and_replaces_it_only_with_force(work, result):
    (result / "scan_heatmap.png").write_bytes(b"my own figure")
    before = tree(work)
    one_line_error(cli(work, "plot", "r"), "scan_heatmap.png", "--force")
    assert tree(work) == before
    assert cli(work, "plot", "r", "--force").returncode == 0
    assert (result / "scan_heatmap.png").read_bytes() != b"my own figure"
    assert "scan_heatmap.png" in read_manifest(result).added
    assert cli(work, "plot", "r").returncode == 0  # its own plots it may replace


def test_plot_writes_every_png_or_none(work, result):
    (result / "dpp_windows.png").mkdir()  # the fourth plot cannot go there
    before = tree(work)
    one_line_error(cli(work, "plot", "r", "--force"), "dpp_windows.png")
    assert tree(work) == before


def test_plots_that_fail_to_move_in_part_way_put_the_old_ones_back(work, result, monkeypatch,
                                                                    capsys):
    assert cli(work, "plot", "r").returncode == 0
    (result / "dpp_windows.png").write_bytes(b"an earlier plot")  # told apart from a new one
    before = tree(work)
    real = {"rename": os.rename, "replace": os.replace}

    def failing(name):
        def move(src, dst, *a, **kw):
            moving_in = Path(src).parent.name == "r" and ".partial" in Path(src).parent.parent.name
            if moving_in and Path(dst).name == "scan_marey.png":  # the third of four
                raise OSError(28, "No space left on device", str(dst))
            return real[name](src, dst, *a, **kw)
        return move

    monkeypatch.setattr(os, "rename", failing("rename"))
    monkeypatch.setattr(os, "replace", failing("replace"))
    code = main(["plot", str(result)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "No space left" in err[0], err
    assert tree(work) == before


def test_calibrate_never_writes_over_its_scenario(work):
    scenario = work / "s.yaml"
    scenario.write_text((ROOT / "scenarios" / "fidelity" / "cpu_tiny.yaml").read_text())
    assert cli(work, "run", "s.yaml", "--out", "m", "--quiet").returncode == 0
    before = tree(work)
    proc = cli(work, "calibrate", "m", "--scenario", "s.yaml", "--out", "s.yaml", "--force")
    one_line_error(proc, "--out", "s.yaml", "input")
    assert tree(work) == before


@pytest.mark.parametrize("argv", [
    ["export-trace", "r", "--out", "mine.json"],
    ["align", "r", "--out", "mine.json"],
    ["sweep", "grid.yaml", "--out", "mine.csv"],
    ["validate-detector", "--trials", "1", "--csv", "mine.csv"],
    ["calibrate", "r", "--scenario", "tiny.yaml", "--out", "mine.yaml"],
])
def test_a_users_file_is_replaced_only_with_force(work, result, argv):
    (work / "grid.yaml").write_text(SWEEP)
    (work / argv[argv.index("--out" if "--out" in argv else "--csv") + 1]).write_text("mine")
    before = tree(work)
    proc = cli(work, *argv)
    one_line_error(proc, "mine.", "--force")
    assert proc.stdout == "" and tree(work) == before  # refused before any work
    assert cli(work, *argv, "--force").returncode == 0


def test_sweep_checks_out_before_any_point_runs(work):
    (work / "grid.yaml").write_text(SWEEP)
    (work / "x.csv").mkdir()
    before = tree(work)
    proc = cli(work, "sweep", "grid.yaml", "--out", "x.csv")
    one_line_error(proc, "--out", "x.csv", "directory")
    assert proc.stdout == "" and tree(work) == before


# ----------------------------------------------- case 12: path errors are one line
def test_a_partial_name_with_an_enormous_pid_is_left_alone(work):
    odd = work / ".x.partial-99999999999999999999"
    odd.mkdir()
    (odd / STAGING_MARKER).write_text(os.uname().nodename)
    (odd / "keep.txt").write_text("mine")
    before = tree(work)
    proc = cli(work, "run", "tiny.yaml", "--out", "x", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert {k: v for k, v in tree(work).items() if not k.startswith("x")} == before


def test_an_out_through_a_symlink_loop_is_one_line(work):
    os.symlink("loop", work / "loop")
    one_line_error(cli(work, "run", "tiny.yaml", "--out", "loop/res", "--quiet"), "--out", "loop")


@pytest.mark.parametrize("out", ["n" * 256, "/".join(["d" * 200] * 25)])
def test_names_and_paths_too_long_are_one_line(work, out):
    before = tree(work)
    one_line_error(cli(work, "run", "tiny.yaml", "--out", out, "--quiet"), "--out")
    assert tree(work) == before


def test_the_longest_legal_name_is_a_result(work):
    proc = cli(work, "run", "tiny.yaml", "--out", "n" * 255, "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert read_manifest(work / ("n" * 255)) is not None


def test_scope_generate_refuses_the_current_directory_before_any_work(work):
    before = tree(work)
    proc = cli(work, "scope", "generate", "no-such-checkpoint", "--prompt", "a", "--out", ".")
    one_line_error(proc, "--out", "current directory")
    assert tree(work) == before
