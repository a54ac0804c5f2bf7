"""SIGINT, SIGTERM and SIGHUP stop a command in order instead of killing it.

Inside ``stop_on_signals()`` the first of these signals raises ``Interrupted``
in the main thread. It is a ``BaseException`` like ``KeyboardInterrupt``: it
unwinds through ``finally`` blocks and context managers (a launcher stops its
worker processes, a staged output directory is removed) and the command line
prints it as one line and exits with ``128 + signal number``. Later signals are
ignored while the stop runs (the stop itself is bounded).

A launcher may add what it did to the exception with ``add_note`` (e.g.
``"stopped 4 ranks"``); ``line()`` appends the notes.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from types import FrameType
from typing import Iterator

from ..errors import Recreatable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(Recreatable, BaseException):
    """The command was asked to stop by a signal (``args`` is ``(signum,)``, so
    the simulator can re-raise it as SimPy does, ``type(e)(*e.args)``)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM

    def line(self) -> str:
        notes = getattr(self, "__notes__", [])
        return "; ".join([f"interrupted ({signal.Signals(self.signum).name})", *notes])


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn the stop signals into ``Interrupted`` (main thread only; elsewhere
    Python cannot install handlers and this does nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        for sig in STOP_SIGNALS:  # the stop runs once
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: installed outside Python, cannot be restored
                signal.signal(sig, handler)
