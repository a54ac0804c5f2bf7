"""A hung run fails with one line instead of waiting forever.

Each rank counts the operations it enters in a shared-memory slot (one ctypes
store per op, no message) and remembers the op it is in. The launcher watches
the counters: once any rank has started its program, if no counter moves for
``timeout_s`` it raises a shared flag; each rank answers from a thread (its main
thread may be blocked inside a gloo/NCCL wait, which releases the GIL) with
the op it is blocked in, and the launcher stops every rank and reports
``deadlock: ... rank 0 on Recv(src=1, tag=...)`` the way the simulator's
``SimDeadlock`` does.

A rank that raises or dies is one line too: ``describe_failure`` sums up an
exception as its type, first message line and the innermost frame (the full
traceback travels beside it), ``death_line`` names an exit code or signal.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from megatronapp.parallel.ops import Compute, Op, Wait, WaitAny
from megatronapp.parallel.ops import describe as describe_op

STALL_TIMEOUT_S = 300.0
FLAG_POLL_S = 0.2
FINISHED = "finished"
MESSAGE_CHARS = 300  # of an exception's message, in the one line


def describe_blocked(op: Op | None) -> str:
    """What a rank waits in: a Wait names the transfer it waits for."""
    if isinstance(op, Wait):
        return f"Wait({describe_op(op.handle.op)})" if hasattr(op.handle, "op") else "Wait"
    if isinstance(op, WaitAny):
        pending = [describe_op(h.op) for h in op.handles
                   if hasattr(h, "op") and not getattr(h, "finished", False)]
        return f"WaitAny({', '.join(pending)})"
    if op is None:
        return "set-up"
    return f"Compute({op.name})" if isinstance(op, Compute) else describe_op(op)


class OpBeacon:
    """One rank's progress as the launcher sees it."""

    def __init__(self, counters: Any, rank: int):
        self.counters, self.rank = counters, rank  # counters: shared ctypes array
        self.current: Op | None = None
        self.finished = False

    def entered(self, op: Op) -> None:
        self.current = op
        self.counters[self.rank] += 1

    def finish(self) -> None:
        self.finished = True
        self.counters[self.rank] += 1

    def describe(self) -> str:
        return FINISHED if self.finished else describe_blocked(self.current)

    def answer_when(self, flag: Any, report: Callable[[str], None]) -> None:
        """Report the blocked op once ``flag`` (a shared ctypes value) is set.
        Polled, not an mp.Event: ``Event.set`` waits for every waiter to wake,
        and a rank that died never does."""
        def answer() -> None:
            while not flag.value:
                time.sleep(FLAG_POLL_S)
            report(self.describe())

        threading.Thread(target=answer, daemon=True, name="stall-report").start()


@dataclass
class ProgressWatch:
    """Stall policy: armed once any rank has entered an op (set-up, i.e.
    imports and model building, is not timed); stalled when no counter has
    moved for ``timeout_s``."""

    timeout_s: float
    _last: tuple[int, ...] = ()
    _since_s: float = 0.0

    def stalled(self, counters: Sequence[int], now_s: float) -> bool:
        snapshot = tuple(counters)
        if snapshot != self._last or not any(snapshot):
            self._last, self._since_s = snapshot, now_s
            return False
        return now_s - self._since_s >= self.timeout_s


def blocked_line(blocked: dict[int, str]) -> str:
    """``N rank(s) blocked: rank 0 on Recv(...), ...`` (finished ranks left out)."""
    waiting = {r: what for r, what in sorted(blocked.items()) if what != FINISHED}
    if not waiting:
        return "no other rank blocked"
    shown = ", ".join(f"rank {r} on {what}" for r, what in list(waiting.items())[:8])
    more = f" (+{len(waiting) - 8} more)" if len(waiting) > 8 else ""
    return f"{len(waiting)} rank(s) blocked: {shown}{more}"


@dataclass(frozen=True)
class Failure:
    """A worker's exception as the launcher reports it."""

    line: str  # ``AssertionError: 127 is not divisible by 2 (megatron/core/utils.py:468)``
    traceback: str


def short_path(filename: str, roots: Sequence[str] | None = None) -> str:
    """A source file relative to the longest ``sys.path`` entry holding it
    (``megatron/core/utils.py`` rather than the virtualenv's full path)."""
    holders = [r for r in (sys.path if roots is None else roots)
               if r and filename.startswith(os.path.join(r, ""))]
    return os.path.relpath(filename, max(holders, key=len)) if holders else filename


def describe_failure(err: BaseException) -> Failure:
    """``Type: first line of the message (file:line)`` of where it was raised."""
    message = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {message[0][:MESSAGE_CHARS]}" if message else type(err).__name__
    frames = traceback.extract_tb(err.__traceback__)
    if frames:
        text += f" ({short_path(frames[-1].filename)}:{frames[-1].lineno})"
    return Failure(text, "".join(traceback.format_exception(err)))


def death_line(rank: int, exitcode: int, ops: int) -> str:
    """``rank 1 died with exit code 3`` or ``rank 1 was killed by SIGKILL``, after N ops."""
    if exitcode < 0:
        try:
            how = f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
    else:
        how = f"died with exit code {exitcode}"
    return f"rank {rank} {how} after {ops} ops"
