"""Worker processes live no longer than their launcher, and stopping them is bounded.

- ``die_with_parent``: a worker asks Linux to SIGKILL it when the launcher dies
  (``prctl(PR_SET_PDEATHSIG)``), so a launcher killed by SIGKILL, which cannot
  clean up, leaves no orphan behind. If the launcher died before the call
  (a spawned worker imports torch first), the worker kills itself at once.
- ``terminal_signals_held``: the launcher owns the stop. Workers start with
  SIGINT and SIGHUP blocked (the mask is inherited through fork and exec, so
  a Ctrl-C reaching the whole foreground process group during a worker's
  imports prints nothing) and ignore them from ``ignore_terminal_signals`` on.
- ``stop_processes``: SIGTERM (and SIGCONT, so that a stopped process can act
  on it), SIGKILL after a grace period, joins with timeouts: never waits
  forever on a stopped, hung or dead process.
- ``process_state``: the kernel's one-letter state of a process (``T`` =
  stopped), for naming a stopped rank that cannot answer.

The parent-death signal belongs to the *thread* that started the worker:
start workers from a thread that outlives the run (the CLI's main thread).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
TERMINAL_SIGNALS = (signal.SIGINT, signal.SIGHUP)
TERM_GRACE_S = 3.0  # SIGTERM -> SIGKILL
KILL_WAIT_S = 2.0  # after SIGKILL: the kernel reaps at once unless a process is in state D


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when ``parent_pid`` (its launcher) exits (Linux;
    elsewhere only the check that the launcher is still there)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent_pid:  # the launcher died before the call: nobody waits for us
        os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def terminal_signals_held() -> Iterator[None]:
    """Block SIGINT and SIGHUP in this thread while workers are started: they
    inherit the mask; a signal for the launcher is delivered on leaving."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, TERMINAL_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_terminal_signals() -> None:
    """In a worker: ignore SIGINT and SIGHUP (pending ones included), then unblock them."""
    for sig in TERMINAL_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, TERMINAL_SIGNALS)


def process_state(pid: int | None) -> str:
    """``R``, ``S``, ``D``, ``T`` (stopped), ``t`` (traced), ``Z``...; ``?`` if unknown."""
    if pid is None:
        return "?"
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return "?"
    return stat[stat.rfind(")") + 2:][:1] or "?"  # the command name may hold spaces and ')'


def is_stopped(pid: int | None) -> bool:
    return process_state(pid) in ("T", "t")


def _join_all(procs: Sequence[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))


def _signal(p: Any, sig: int) -> None:
    try:
        os.kill(p.pid, sig)
    except ProcessLookupError:  # exited meanwhile
        pass


def _kill(procs: Sequence[Any]) -> None:
    for p in procs:
        if p.is_alive():
            _signal(p, signal.SIGKILL)
    _join_all(procs, KILL_WAIT_S)


def stop_processes(procs: Sequence[Any], grace_s: float = TERM_GRACE_S) -> int:
    """Stop every live process of ``procs`` (``multiprocessing.Process``):
    SIGTERM + SIGCONT, SIGKILL after ``grace_s``; returns how many were alive."""
    alive = [p for p in procs if p.is_alive()]
    try:
        for p in alive:
            _signal(p, signal.SIGTERM)
            _signal(p, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
        _join_all(alive, grace_s)
    except BaseException:  # a signal interrupted the stop: finish it at once
        _kill(alive)
        raise
    _kill(alive)
    return len(alive)


def join_or_stop(procs: Sequence[Any], timeout_s: float) -> None:
    """After a good run: let finished workers exit, stop those that do not in time."""
    _join_all(procs, timeout_s)
    stop_processes(procs)
