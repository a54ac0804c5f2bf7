"""SIGTERM, SIGHUP and SIGINT become an orderly stop (in this process, real signals)."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from megatronapp import cli
from megatronapp.io.interrupts import Interrupted, stop_on_signals


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_stop_signal_raises_interrupted_once_and_handlers_come_back(sig: signal.Signals):
    before = signal.getsignal(sig)
    with pytest.raises(Interrupted) as caught:
        with stop_on_signals():
            os.kill(os.getpid(), sig)
            time.sleep(5)  # the handler runs at once; this is never reached in full
    assert caught.value.signum == sig and caught.value.exit_status == 128 + sig
    assert caught.value.line() == f"interrupted ({sig.name})"
    assert signal.getsignal(sig) == before


def test_a_signal_during_the_stop_does_not_interrupt_it():
    finished_stop = []
    with pytest.raises(Interrupted) as caught:
        with stop_on_signals():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            finally:  # what a launcher does while it stops its workers
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                finished_stop.append(True)
    assert finished_stop and caught.value.signum == signal.SIGTERM


def test_notes_of_what_was_stopped_join_the_line():
    stop = Interrupted(signal.SIGTERM)
    stop.add_note("stopped 4 ranks")
    assert stop.line() == "interrupted (SIGTERM); stopped 4 ranks"


def test_the_cli_turns_a_signal_into_one_line_and_removes_its_staged_output(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """The simulator backend interrupted mid-run: exit 143, one line, nothing left."""
    from backends.sim import SimBackend

    real_run = SimBackend.run

    def run_then_terminated(*args, **kw):
        real_run(*args, **kw)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)

    monkeypatch.setattr(SimBackend, "run", run_then_terminated)
    scenario = tmp_path / "s.yaml"
    scenario.write_text("parallel: {pp: 2}\nmodel: {layers: 2}\n")
    code = cli.main(["run", str(scenario), "--out", str(tmp_path / "run"), "--quiet"])
    assert code == 143
    assert capsys.readouterr().err == "megatronapp: interrupted (SIGTERM)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"]
