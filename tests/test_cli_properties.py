"""Every subcommand driven with argv drawn from its own argparse parser.

For each (sub)command parser, hypothesis draws an argv from its actions:
positional arguments and options taking paths get existing inputs and hostile
ones (a name longer than the file system takes, a missing path, a FIFO,
``/dev/zero``, a link loop, a folder, garbage, deep or non-UTF-8 files),
numbers are huge, negative, zero, NaN or infinite, strings are non-UTF-8
(as Python decodes such bytes) or deeply nested YAML. Each argv runs through
the real ``megatronapp.cli.main`` in a worker process capped in memory and
stopped by an alarm (``tests/cli_worker.py``), in a fresh folder of inputs,
and must keep the contract: exit 0 or 2, never a traceback, exit 2 with one
line on stderr, within the time and memory allowed, and nothing written
outside its output options and the places it documents (``runs/`` under the
working folder; a result's own folder, for the commands that add to one).

``MEGATRONAPP_CLI_EXAMPLES`` sets the examples per subcommand (default 5,
the quick profile CI runs); the tally of how examples ended is printed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from megatronapp.cli import build_parser
from megatronapp.host.limits import positive_seconds

from .support import ROOT

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("MEGATRONAPP_CLI_EXAMPLES", "5"))
SECONDS = 90.0  # a command's time; the runs drawn are kept small by --max-seconds
MAX_SECONDS = "20"  # added where a command takes --max-seconds and none was drawn
GRACE_S = 30.0  # past its alarm, how long a command may take to stop
MEMORY = 2 << 30  # resident memory a command may add
# derandomized (the same examples on every run) and not shrunk: a failing example is
# reported as drawn, within the time CI gives the test
PROFILE = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                   phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
LONG = "n" * 300
OUTPUT_OPTIONS = {"out", "csv", "report", "save_runs"}
ADDS_TO_INPUT = {"plot", "align", "export-trace", "report", "scope lens", "scope patch",
                 "scope dla"}  # with no --out, a file beside (or in) the run or trace it reads


def subcommands() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    def walk(parser: argparse.ArgumentParser, path: list[str]
             ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield " ".join(path), parser
        for action in subs:
            for name, sub in action.choices.items():
                yield from walk(sub, [*path, name])
    yield from walk(build_parser(), [])


COMMANDS = dict(subcommands())


# ------------------------------------------------------------------ inputs
def make_inputs(root: Path, run: Path) -> None:
    """The folder each example runs in: real inputs (a copy of ``run``) beside hostile ones."""
    shutil.copy(ROOT / "scenarios/throttle.yaml", root / "scenario.yaml")
    shutil.copytree(run, root / "run")
    (root / "spec.yaml").write_text("scenario: scenario.yaml\nseeds: 2\n")
    (root / "trace.json").write_text(json.dumps({"traceEvents": [
        {"ph": "X", "name": "forward", "pid": r, "ts": 10.0 * r, "dur": 5.0} for r in (0, 1)]}))
    (root / "garbage.bin").write_bytes(bytes(range(256)) * 64)
    (root / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (root / "nonutf8.yaml").write_bytes(b"name: \xff\xfe\n")
    (root / "folder").mkdir()
    os.mkfifo(root / "fifo")
    (root / "zero").symlink_to("/dev/zero")
    (root / "loop").symlink_to(root / "loop")


INPUTS = ["scenario.yaml", "run", "run/trace.parquet", "spec.yaml", "trace.json", "garbage.bin",
          "deep.json", "nonutf8.yaml", "folder", "fifo", "zero", "/dev/zero", "loop", "missing",
          LONG, f"folder/{LONG}/x"]
OUTPUTS = ["o/out.json", "o/t.parquet", "o/t.csv", "o/r.html", "o/d", "run", "fifo", "zero",
           "folder", LONG, "/proc/x.html", "scenario.yaml"]
NUMBERS = ["0", "-1", "1", "2", "3", "nan", "inf", "-inf", "1e308", "1e-300", "2147483648",
           "9" * 40, "0.5", "x"]
STRINGS = ["", "a", "def f(x):", "\udcff\udcfe", "€", "[" * 200 + "]" * 200,
           "{kind: act_noise, site: resid_post, layers: [1], sigma: nan}", LONG,
           "SELECT count(*) FROM events", "SELECT 1; SELECT 2", "COPY (SELECT 1) TO 'x.csv'",
           "0-2147483647", "1,2,-3", "127.0.0.1:1", "::"]
TEXT_ARGUMENTS = {"sql", "prompt", "clean", "corrupt", "answer", "baseline", "clean_answer",
                  "corrupt_answer", "ranks", "iterations", "schedules", "sites", "host", "ray",
                  "memory_limit", "perturb"}
SETTINGS = ["iterations=2", "parallel.dp=1000000", "iterations=nan", "seed=-1",
            "model=" + "[" * 200 + "]" * 200, "faults.0.factor=1e308", "no.such=1", "=",
            "parallel.pp=\udcff"]


def value(action: argparse.Action) -> st.SearchStrategy[str]:
    if action.choices:
        return st.sampled_from([*map(str, action.choices), "nope"])
    kind = action.type
    if kind in (int, float, positive_seconds) or getattr(kind, "__name__", "") in (
            "row_count", "count", "_seconds", "_interval"):
        return st.sampled_from(NUMBERS)
    if action.dest in OUTPUT_OPTIONS:
        return st.sampled_from(OUTPUTS)
    if action.dest == "set":
        return st.sampled_from(SETTINGS)
    if action.dest in TEXT_ARGUMENTS:
        return st.sampled_from(STRINGS)
    return st.sampled_from(INPUTS) if not action.option_strings else st.one_of(
        st.sampled_from(INPUTS), st.sampled_from(STRINGS))


@st.composite
def argv_of(draw: st.DrawFn, command: str) -> list[str]:
    parser = COMMANDS[command]
    argv = command.split()
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    for a in actions:
        if a.dest in ("no_limits", "max_seconds"):
            continue  # going past the limits is a choice: bounded time is not asked then
        if a.option_strings:
            if not a.required and not draw(st.booleans()):
                continue
            argv.append(a.option_strings[-1])
            if a.nargs == 0:
                continue
            count = draw(st.integers(1, 2)) if a.nargs in ("+", "*") else 1
            argv += [draw(value(a)) for _ in range(count)]
        elif draw(st.integers(0, 9)) < 9:  # now and then a positional is left out
            argv.append(draw(value(a)))
    options = {s for a in actions for s in a.option_strings}
    if "--max-seconds" in options and "--max-seconds" not in argv:
        argv += ["--max-seconds", MAX_SECONDS]
    if command == "watch" and "--idle" not in argv:
        argv += ["--idle", "1"]
    return argv


# ------------------------------------------------------------------ the worker
class Worker:
    """The worker process (a session of its own); started again after a crash,
    and stopped with everything it started when a command does not end."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "tests.cli_worker"], cwd=ROOT,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"})

    def ask(self, argv: list[str], cwd: Path) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd),
                                          "seconds": SECONDS}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], SECONDS + GRACE_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            code = "hung" if not ready else f"worker died ({self.proc.wait()})"
            self.close()
            return {"code": code, "out": "", "err": "", "seconds": SECONDS, "memory": 0}
        return json.loads(line)

    def close(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the worker and what its command started
            self.proc.wait()


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.close()


@dataclass
class Tally:
    """How the examples ended, and each one that broke the contract."""

    ends: Counter[str] = field(default_factory=Counter)
    found: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def tally() -> Iterator[Tally]:
    """Printed at the end: the example count, the time, how they ended."""
    seen, started = Tally(), time.monotonic()
    yield seen
    print(f"\nCLI property test: {sum(seen.ends.values())} examples over {len(COMMANDS)} "
          f"commands in {time.monotonic() - started:.0f} s: " +
          ", ".join(f"{k}: {v}" for k, v in sorted(seen.ends.items())))
    for found in seen.found:
        print(f"  found: {found}")


# ------------------------------------------------------------------ the contract
def snapshot(root: Path) -> dict[str, str]:
    out = {}
    for parent, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(parent) / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink() or not path.is_file():
                out[rel] = "link" if path.is_symlink() else "other"
            else:
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def allowed(command: str, argv: list[str], root: Path) -> tuple[list[str], str | None]:
    """Where ``argv`` may write: its output options, runs/ and a run it adds to
    (the folders), and the folder beside a trace file it reads, where it may
    add new files (not replace one)."""
    roots = ["runs"]
    for flag in ("--out", "--csv", "--report", "--save-runs"):
        if flag in argv[:-1]:
            roots.append(os.path.normpath(argv[argv.index(flag) + 1]))
    if command == "calibrate" and "--scenario" in argv[:-1]:
        scenario = argv[argv.index("--scenario") + 1]
        roots.append(os.path.splitext(os.path.normpath(scenario))[0] + ".calibrated.yaml")
    read = argv[len(command.split())] if len(argv) > len(command.split()) else ""
    if command not in ADDS_TO_INPUT or not read:
        return roots, None
    if _is_dir(root / read):
        return [*roots, os.path.normpath(read)], None
    beside = os.path.normpath(os.path.dirname(read) or ".")
    return [*roots, os.path.join(beside, "manifest.json")], beside  # a result records what joins it


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a name too long, a loop: no folder to write in
        return False


def check(command: str, argv: list[str], root: Path, before: dict[str, str],
          answer: dict[str, Any]) -> None:
    detail = f"argv {argv!r}: exit {answer['code']}; stderr: {answer['err'][-3000:]}"
    assert answer["code"] in (0, 2), detail
    assert "Traceback" not in answer["err"], detail
    if answer["code"] == 2:
        lines = answer["err"].strip().splitlines()
        assert len(lines) >= 1 and lines[-1].startswith("megatronapp"), detail
        assert len([line for line in lines if line.startswith("megatronapp:")]) == 1, detail
    assert answer["memory"] < MEMORY, f"{detail}; {answer['memory'] / 1e9:.2f} GB"
    after = snapshot(root)
    roots, beside = allowed(command, argv, root)
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    stray = {p for p in changed
             if not any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots)
             and not (p not in before and os.path.normpath(os.path.dirname(p) or ".") == beside)}
    assert not stray, f"{detail}; written outside its outputs: {sorted(stray)[:5]}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_keeps_the_contract(command: str, worker: Worker, tally: Tally,
                                             throttle_run: Path,
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    @PROFILE
    @given(argv=argv_of(command))
    def example(argv: list[str]) -> None:
        root = tmp_path_factory.mktemp("cli")
        make_inputs(root, throttle_run)
        before = snapshot(root)
        answer = worker.ask(argv, root)
        tally.ends[f"exit {answer['code']}"] += 1
        try:
            check(command, argv, root, before, answer)
        except AssertionError:
            last = (answer["err"].strip().splitlines() or [""])[-1]
            tally.found.append(f"{argv!r}: exit {answer['code']}: {last[:300]}")
            raise

    example()
