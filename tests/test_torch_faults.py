"""Faults against the torch backend's processes, for real: no hang, no orphan,
no half-written result, one line saying what happened.

Each drill starts ``megatronapp run --backend torch`` in a session of its own,
waits for its two worker processes (rank order = start order), injects a
fault, and records the exit status, stderr, which of the CLI's child
processes outlived it, and what is left in the output's parent directory.
``python -m tests.test_torch_faults`` prints the table of every drill.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from backends.torch import launch
from megatronapp import cli
from megatronapp.parallel.ops import Compute

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = {"name": "faulted", "seed": 5, "iterations": 5000, "schedule": "1f1b",
            "parallel": {"tp": 1, "pp": 2, "dp": 1, "microbatches": 2},
            "model": {"layers": 2, "hidden": 32, "heads": 4, "seq_len": 8, "vocab": 64,
                      "micro_batch_size": 2}}
STALL_TIMEOUT_S = 3
SAFETY_S = 240.0  # a drill that has not ended by then is a hang: the test fails
SIGINT_BIT = 1 << (signal.SIGINT - 1)
# Write system calls of rank 0 after its own code starts by which it trains:
# set-up (megatron imports, groups, model) makes about 100 (and took 1.5-5
# CPU s, too close to any CPU budget on a slower machine); training makes
# about 600 a second (a message to its peer and a record to the launcher per op)
TRAINING_WRITES = 1000

pytestmark = pytest.mark.slow


# ------------------------------------------------------------ /proc helpers
def _stat(pid: int) -> list[str] | None:
    """Fields after the command name of /proc/PID/stat (state first); None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def children(pid: int) -> list[int]:
    """Child processes of ``pid``, in start order."""
    found = []
    for entry in Path("/proc").iterdir():
        fields = _stat(int(entry.name)) if entry.name.isdigit() else None
        if fields is not None and int(fields[1]) == pid:
            found.append((int(fields[19]), int(entry.name)))  # (starttime, pid)
    return [p for _, p in sorted(found)]


def writes(pid: int) -> int:
    """Write system calls a process has made (0 once it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/io").read_text().splitlines()
    except OSError:
        return 0
    return next(int(line.split()[1]) for line in lines if line.startswith("syscw:"))


def is_worker(pid: int) -> bool:
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def alive(pid: int) -> bool:
    """Running, sleeping or stopped: not exited (a zombie has exited)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def ignores_sigint(pid: int) -> bool:
    """Workers ignore SIGINT once their own code runs (imports done, parent-death signal set)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    ignored = next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:"))
    return bool(int(ignored, 16) & SIGINT_BIT)


def poll(condition: Callable[[], bool], limit_s: float = SAFETY_S) -> bool:
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ------------------------------------------------------------------ drills
@dataclass(frozen=True)
class Outcome:
    status: int | None  # None: still running after SAFETY_S (a hang)
    stderr: str
    survivors: list[int]  # the CLI's children still alive after it ended
    leftovers: list[str]  # what the run left beside the scenario file
    exit_s: float = 0.0  # from the fault to the CLI's exit (reported, never asserted)


Fault = Callable[[subprocess.Popen, list[int]], None]  # (the CLI, its workers in rank order)


@dataclass(frozen=True)
class Drill:
    fault: Fault
    wait_running: bool = True  # fault once the workers' own code runs (else while they import)
    train_writes: int = 0  # ... and rank 0 has made this many more writes (load-proof)


def drill(tmp: Path, d: Drill) -> Outcome:
    """Run the CLI in ``tmp/work``, inject ``d``'s fault, see what is left. stderr
    goes to a file, not a pipe, which an orphan would hold open after the CLI exits."""
    work = tmp / "work"
    work.mkdir()
    scenario = work / "faulted.yaml"
    scenario.write_text(yaml.safe_dump(SCENARIO))
    cmd = [sys.executable, "-m", "megatronapp.cli", "run", str(scenario), "--backend", "torch",
           "--out", str(work / "run"), "--quiet", "--stall-timeout", str(STALL_TIMEOUT_S)]
    with open(tmp / "stderr.txt", "w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
        try:
            assert poll(lambda: sum(map(is_worker, children(proc.pid))) == 2), "no workers"
            workers = [p for p in children(proc.pid) if is_worker(p)]
            if d.wait_running:  # a bounded wait: code that never ignores SIGINT is drilled too
                poll(lambda: all(map(ignores_sigint, workers)), limit_s=60.0)
            base = writes(workers[0])
            poll(lambda: writes(workers[0]) - base >= d.train_writes)
            recorded = children(proc.pid)  # workers and multiprocessing's resource tracker
            d.fault(proc, workers)
            faulted = time.monotonic()
            try:
                proc.wait(timeout=SAFETY_S)
            except subprocess.TimeoutExpired:
                return Outcome(None, "", [], [], SAFETY_S)
            exit_s = time.monotonic() - faulted
            poll(lambda: not any(map(alive, recorded)), limit_s=30.0)  # orphans exit by themselves
            err.seek(0)
            return Outcome(proc.returncode, err.read(), [p for p in recorded if alive(p)],
                           sorted(p.name for p in work.iterdir() if p != scenario), exit_s)
        finally:
            _kill_session(proc)


def _kill_session(proc: subprocess.Popen) -> None:
    """Whatever the drill left running (a failed test), end it: the session is ours."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def signal_worker(proc: subprocess.Popen, workers: list[int], sig: int, rank: int = 1) -> None:
    os.kill(workers[rank], sig)


def signal_cli(proc: subprocess.Popen, workers: list[int], sig: int) -> None:
    os.kill(proc.pid, sig)


def ctrl_c(proc: subprocess.Popen, workers: list[int]) -> None:
    """A terminal's Ctrl-C: SIGINT to the whole foreground process group."""
    os.killpg(proc.pid, signal.SIGINT)


DRILLS = {
    "SIGSTOP rank 1 in set-up": Drill(partial(signal_worker, sig=signal.SIGSTOP)),
    "SIGSTOP rank 1 in training": Drill(partial(signal_worker, sig=signal.SIGSTOP),
                                        train_writes=TRAINING_WRITES),
    "SIGKILL rank 1 in set-up": Drill(partial(signal_worker, sig=signal.SIGKILL)),
    "SIGKILL rank 1 in training": Drill(partial(signal_worker, sig=signal.SIGKILL),
                                        train_writes=TRAINING_WRITES),
    "SIGTERM the CLI": Drill(partial(signal_cli, sig=signal.SIGTERM),
                             train_writes=TRAINING_WRITES),
    "SIGHUP the CLI": Drill(partial(signal_cli, sig=signal.SIGHUP),
                            train_writes=TRAINING_WRITES),
    "SIGKILL the CLI": Drill(partial(signal_cli, sig=signal.SIGKILL),
                             train_writes=TRAINING_WRITES),
    "Ctrl-C while workers import": Drill(ctrl_c, wait_running=False),
}


def _clean_end(outcome: Outcome, status: int) -> str:
    """The CLI ended with ``status`` and one line on stderr, no child process
    outlived it, nothing is left beside the scenario; returns the line."""
    assert outcome.status is not None, "the CLI hung"
    assert outcome.stderr.count("\n") == 1 and "Traceback" not in outcome.stderr, outcome.stderr
    assert outcome.status == status
    assert outcome.survivors == [] and outcome.leftovers == []
    return outcome.stderr.strip()


# ------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", ["SIGSTOP rank 1 in set-up", "SIGSTOP rank 1 in training"])
def test_a_stopped_worker_is_named_and_the_run_ends(tmp_path: Path, name: str):
    line = _clean_end(drill(tmp_path, DRILLS[name]), 2)
    assert line.startswith("megatronapp: rank 1 stopped (process state T")
    assert "rank 0 on " in line  # its peer answered where it waits
    assert ("on set-up" in line) == name.endswith("set-up")


@pytest.mark.parametrize("name", ["SIGKILL rank 1 in set-up", "SIGKILL rank 1 in training"])
def test_a_killed_worker_is_named_and_the_run_ends(tmp_path: Path, name: str):
    line = _clean_end(drill(tmp_path, DRILLS[name]), 2)
    assert line.startswith("megatronapp: rank 1 was killed by SIGKILL after ")
    assert ("after 0 ops;" in line) == name.endswith("set-up")


@pytest.mark.parametrize("name", ["SIGTERM the CLI", "SIGHUP the CLI"])
def test_a_signal_to_the_cli_stops_every_rank_and_leaves_nothing(tmp_path: Path, name: str):
    sig = signal.Signals[name.split()[0]]
    line = _clean_end(drill(tmp_path, DRILLS[name]), 128 + sig)
    assert line == f"megatronapp: interrupted ({sig.name}); stopped 2 ranks"


def test_ctrl_c_while_workers_import_is_one_line(tmp_path: Path):
    line = _clean_end(drill(tmp_path, DRILLS["Ctrl-C while workers import"]), 130)
    assert line == "megatronapp: interrupted (SIGINT); stopped 2 ranks"


def test_workers_die_with_a_killed_cli(tmp_path: Path):
    outcome = drill(tmp_path, DRILLS["SIGKILL the CLI"])
    assert outcome.status == -signal.SIGKILL
    assert outcome.survivors == []  # the parent-death signal, not the CLI, stopped them
    assert "run" not in outcome.leftovers  # no result (a killed process leaves its staging dir)


ORPHAN = """
import os, sys, time
from backends.torch.lifetime import die_with_parent
launcher = int(sys.argv[1])
while os.getppid() == launcher:  # wait until the launcher is gone
    time.sleep(0.01)
open(sys.argv[2] + ".reached", "w").close()
die_with_parent(launcher)
open(sys.argv[2], "w").close()  # reached only if die_with_parent let it live
"""
LAUNCHER = """
import os, subprocess, sys
orphan = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[2]])
print(orphan.pid)
"""


def test_a_worker_started_after_its_launcher_died_kills_itself(tmp_path: Path):
    """The race ``die_with_parent`` covers: the launcher is gone before the call."""
    survived = tmp_path / "survived"
    out = subprocess.run([sys.executable, "-c", LAUNCHER, ORPHAN, str(survived)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True)
    orphan = int(out.stdout)
    assert poll(lambda: not alive(orphan), limit_s=60.0)
    assert Path(f"{survived}.reached").exists() and not survived.exists()


# --------------------------------------------- worker exceptions (in-process CLI)
def rank_one_asserts(s: Any, stages_for: Any) -> dict[int, Any]:
    def fails():
        yield Compute("forward", 0.0, run=partial(_assert_positive, -1))

    def waits():
        yield Compute("forward", 0.0, run=partial(time.sleep, 0.0))
    return {0: waits(), 1: fails()}


def _assert_positive(x: int) -> None:
    assert x > 0, f"{x} is not positive"


@pytest.mark.parametrize("debug", ["", "1"])
def test_a_failing_rank_is_one_line_naming_rank_cause_and_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        debug: str):
    monkeypatch.setattr(launch, "PIPELINE", replace(launch.PIPELINE, programs=rank_one_asserts))
    monkeypatch.setenv("MEGATRONAPP_DEBUG", debug)
    scenario = tmp_path / "faulted.yaml"
    scenario.write_text(yaml.safe_dump({**SCENARIO, "iterations": 1}))
    code = cli.main(["run", str(scenario), "--backend", "torch", "--out", str(tmp_path / "run"),
                     "--quiet"])
    err = capsys.readouterr().err
    line = err.splitlines()[-1]
    assert code == 2
    assert line == ("megatronapp: rank 1 failed: AssertionError: -1 is not positive "
                    f"(tests/test_torch_faults.py:{_assert_positive.__code__.co_firstlineno + 1})")
    if debug:  # the worker's own traceback comes first
        assert "Traceback" in err and "_assert_positive" in err
    else:
        assert err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["faulted.yaml"]


# ------------------------------------------------------------------- table
def fault_table(tmp: Path) -> str:
    """One drill per row: exit status (None: hung), seconds from the fault to
    the CLI's exit, stderr, orphans, leftovers (``--stall-timeout 3``)."""
    rows = ["| fault | exit status | fault to exit | stderr | orphans | leftovers |",
            "|---|---|---|---|---|---|"]
    for i, (name, d) in enumerate(DRILLS.items()):
        (tmp / str(i)).mkdir()
        o = drill(tmp / str(i), d)
        stderr = " ".join(o.stderr.split()) or "(none)"
        rows.append(f"| {name} | {o.status} | {o.exit_s:.1f} s | `{stderr}` | "
                    f"{len(o.survivors)} | {', '.join(o.leftovers) or 'none'} |")
        print(rows[-1], file=sys.stderr)  # progress
    return "\n".join(rows)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmpdir:
        print(fault_table(Path(tmpdir)))
