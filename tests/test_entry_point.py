"""The command line's surface: version, one-line usage errors, help that
lists choices and defaults, progress that stays off pipes, lazy imports."""
from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import version

import pytest

from megatronapp.cli import build_parser
from megatronapp.io.progress import RunProgress
from megatronapp.scan.methods import DETECTORS
from megatronapp.parallel.schedules import SCHEDULES
from megatronapp.trace.events import Event

from .support import ROOT, run_cli

HEAVY = ("matplotlib", "torch", "duckdb", "numpy", "pydantic", "rich", "networkx", "simpy")


def test_version_comes_from_the_package_metadata() -> None:
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout == f"megatronapp {version('megatronapp')}\n"


@pytest.mark.parametrize("argv, line", [
    (["topology", "--tp", "x"], "megatronapp: --tp: invalid int value: 'x'"),
    (["run", "s.yaml", "--backend", "tpu"],
     "megatronapp: --backend: invalid choice: 'tpu' (choose from 'sim', 'torch')"),
    (["detect", "runs/x", "--method", "oracle"], "megatronapp: --method: invalid choice: 'oracle'"),
    (["bogus"], "megatronapp: COMMAND: invalid choice: 'bogus'"),
    (["dpp"], "megatronapp: the following arguments are required: dpp_command"),
])
def test_a_usage_error_is_one_line_and_exit_2(argv: list[str], line: str) -> None:
    result = run_cli(*argv)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(line)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every (nested) subcommand's parser by its prog."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found[sub.prog] = sub
                found.update(_subparsers(sub))
    return found


def test_every_option_of_every_command_has_help() -> None:
    commands = _subparsers(build_parser())
    assert "megatronapp dpp compare" in commands and len(commands) >= 10
    for prog, sub in commands.items():
        for action in sub._actions:
            if not isinstance(action, argparse._SubParsersAction):
                assert action.help, f"{prog} {action.option_strings or action.dest} has no help"


def test_help_lists_choices_and_defaults() -> None:
    commands = _subparsers(build_parser())
    detect = commands["megatronapp detect"].format_help()
    assert all(method in detect for method in DETECTORS) and "(default: megascan)" in detect
    run = commands["megatronapp run"].format_help()
    assert "{sim,torch}" in run and "(default: sim)" in run
    assert "(default: 1)" in commands["megatronapp topology"].format_help()
    compare = " ".join(commands["megatronapp dpp compare"].format_help().split())
    assert all(schedule in compare for schedule in SCHEDULES)


def test_a_finished_run_prints_no_progress_to_a_pipe(tmp_path) -> None:
    result = run_cli("run", str(ROOT / "scenarios" / "throttle.yaml"), "--out",
                     str(tmp_path / "run"), "--set", "iterations=1")
    assert result.returncode == 0 and result.stderr == ""


def test_run_progress_says_the_phase_then_iterations_with_the_loss() -> None:
    progress = RunProgress(iterations=2, enabled=False)
    progress.phase("spawning 4 ranks")
    assert progress.description == "spawning 4 ranks"
    progress.record(3, Event("optimizer", 0.0, 1.0, {"iteration": 0, "loss": 4.25}))
    progress.record(0, Event("optimizer", 0.0, 1.0, {"iteration": 0}))
    progress.record(0, Event("forward", 1.0, 1.0, {"iteration": 1}))
    assert progress.description == "iteration 1/2, loss 4.250"


@pytest.mark.slow
def test_the_command_line_imports_no_heavy_module_until_a_command_runs() -> None:
    code = ("import sys, megatronapp.cli as c; c.build_parser(); "
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.slow
def test_a_simulated_run_never_imports_torch(tmp_path) -> None:
    """torch costs a second of start-up; a scenario without scope: never needs it."""
    out = tmp_path / "run"
    code = ("import sys, megatronapp.cli as c; "
            f"code = c.main(['run', {str(ROOT / 'scenarios' / 'throttle.yaml')!r}, '--quiet', "
            f"'--out', {str(out)!r}]); print(code, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "0 False"


@pytest.mark.slow
def test_the_installed_entry_point_prints_one_line_errors() -> None:
    result = subprocess.run([sys.executable, "-m", "megatronapp.cli", "topology", "--tp", "x"],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "megatronapp: --tp: invalid int value: 'x'\n"


def test_output_into_a_pipe_whose_reader_has_gone_stops_quietly() -> None:
    """``megatronapp predict … --json | head -1``: once the reader has closed
    the pipe, no traceback and no "Exception ignored" at exit; the status of a
    process stopped by SIGPIPE (128 + 13), as other command-line tools end."""
    proc = subprocess.Popen([sys.executable, "-m", "megatronapp.cli", "predict",
                             str(ROOT / "scenarios" / "throttle.yaml"), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes away before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and err == ""
