"""SIGINT and SIGTERM stop a working command in order: exit status 128 +
signal number, one line on stderr, nothing left behind (no result, no
staging directory). Each command runs in its own process on an input big
enough that it is still working when the signal lands: the test waits until
the process has spent ``WORKING_CPU_S`` of CPU time (past its imports) and,
where the command stages output, until its staging directory exists."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import pytest

from .support import ROOT

pytestmark = pytest.mark.slow

WORKING_CPU_S = 4.0  # imports take 1-3 s of CPU; every input below takes minutes
HANG_GUARD_S = 600  # only so that a broken build cannot hang the suite
# ~4.7 M events: predict spends ~12 s of CPU on it and run ~15 s, well past the
# signal (at 50 iterations both ended at 5-7 s, too close to WORKING_CPU_S)
BIG = ("name: big\niterations: 120\nparallel: {tp: 2, pp: 4, dp: 8, microbatches: 32}\n"
       "model: {layers: 8, hidden: 256, heads: 4, seq_len: 256, vocab: 1024}\n"
       "cluster: {jitter: {compute_sigma: 0.05, link_sigma: 0.05}}\n")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (``/proc/PID/stat`` fields 14, 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _staging(directory: Path) -> bool:
    return any(".partial-" in p.name for p in directory.iterdir())


def _stop_when_working(argv: list[str], cwd: Path, sig: signal.Signals,
                       working: Callable[[], bool] = lambda: True,
                       cpu_s: float = WORKING_CPU_S, announced: int = 0
                       ) -> tuple[int, list[str]]:
    """Signal the command once it has used ``cpu_s`` of CPU, ``working()``
    holds and it has said its ``announced`` lines (its stderr is a file
    outside ``cwd``, read as it grows)."""
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "megatronapp.cli", *argv], cwd=cwd,
                                stdout=subprocess.DEVNULL, stderr=stderr, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})

        def said() -> list[str]:
            stderr.seek(0)
            return stderr.read().strip().splitlines()
        try:
            started = time.monotonic()
            while not (_cpu_seconds(proc.pid) >= cpu_s and working()
                       and len(said()) >= announced):
                assert proc.poll() is None, f"finished before the signal: {said()}"
                assert time.monotonic() - started < HANG_GUARD_S
                time.sleep(0.05)
            proc.send_signal(sig)
            proc.wait(timeout=HANG_GUARD_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return proc.returncode, said()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scenario, a run of a million events, a sweep spec and a checkpoint."""
    from backends.torch.scope_generate import initial_state, one_rank
    from megatronapp.scenario.checkpoint import write_checkpoint
    from megatronapp.cli import main
    from megatronapp.scenario.config import Data, parse_scenario

    work = tmp_path_factory.mktemp("inputs")
    (work / "big.yaml").write_text(BIG)
    assert main(["run", str(work / "big.yaml"), "--set", "iterations=30", "--quiet",
                 "--out", str(work / "run")]) == 0
    (work / "spec.yaml").write_text("scenario: big.yaml\nseeds: 2\n")
    s = parse_scenario({"model": {"layers": 2, "hidden": 32, "heads": 4, "seq_len": 12,
                                  "vocab": 40}, "data": {"kind": "random"}})
    with one_rank():  # megatron-core's RNG tracker, on the CPU
        state = initial_state(s)
    write_checkpoint(work / "ckpt", state, s.model, Data(kind="text"), {"iterations": 0})
    return work


COMMANDS = {  # name -> (argv, whether it stages output in the working directory)
    "predict": (["predict", "{inputs}/big.yaml", "--quiet"], False),
    "run": (["run", "{inputs}/big.yaml", "--out", "result", "--quiet"], True),
    "detect": (["detect", "{inputs}/run", "--method", "slowest-mean", "--no-limits"], False),
    "sweep": (["sweep", "{inputs}/spec.yaml", "--out", "table.csv", "--jobs", "1"], False),
    "scope generate": (["scope", "generate", "{inputs}/ckpt", "--prompt", "x", "--tokens",
                        "1000000", "--out", "gen"], True),
}
# sweep announces its runs on stderr before it starts them, after pricing
# them (4-10 s of CPU, by machine): it is signalled once it has said so and
# worked a little past it
ANNOUNCED = {"sweep": 1}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_signal_stops_a_working_command_in_order(command, sig, inputs, tmp_path):
    argv, stages = COMMANDS[command]
    code, err = _stop_when_working([a.format(inputs=inputs) for a in argv], tmp_path, sig,
                                   (lambda: _staging(tmp_path)) if stages else (lambda: True),
                                   WORKING_CPU_S, ANNOUNCED.get(command, 0))
    assert code == 128 + sig, "\n".join(err)  # the whole of it: a traceback's tail says where
    assert len(err) == 1 + ANNOUNCED.get(command, 0), err
    assert err[-1] == f"megatronapp: interrupted ({sig.name})"
    assert list(tmp_path.iterdir()) == []
