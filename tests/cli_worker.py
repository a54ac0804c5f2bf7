"""A process that runs the real command line (``megatronapp.cli.main``) again
and again, for the property test over every subcommand's parser.

It reads one JSON request a line on stdin (``argv``, ``cwd``, ``seconds``) and
answers one JSON line on stdout: the exit status, what the command printed on
stdout and stderr, its wall time and the peak resident memory it reached above
the worker's own. Its address space is capped (``RLIMIT_AS``) when it starts,
and each command is stopped by an alarm after ``seconds``: a command that
would read without end, allocate without bound or hang is seen as such, and a
crash ends the worker (the test starts another). Running in one process keeps
the imports out of each example's time.
"""
from __future__ import annotations

import io
import json
import os
import resource
import signal
import sys
import threading
import time
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

MEMORY_CAP = 6 << 30  # address space of the worker (torch maps much it never touches)


class Overtime(BaseException):
    """Raised in the command by the alarm: it ran longer than it may."""


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


class PeakMemory:
    """The largest resident size seen while a command runs (sampled every 5 ms)."""

    def __init__(self) -> None:
        self.peak, self.running = 0, False

    def __enter__(self) -> "PeakMemory":
        self.base, self.peak, self.running = _rss(), _rss(), True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def __exit__(self, *_exc: object) -> None:
        self.running = False
        self.thread.join()


def _overtime(_signum: int, _frame: Any) -> None:
    raise Overtime


def run(argv: list[str], cwd: str, seconds: float) -> dict[str, Any]:
    from megatronapp.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)
    start = time.monotonic()
    code: int | str
    try:
        with PeakMemory() as memory, redirect_stdout(out), redirect_stderr(err):
            signal.setitimer(signal.ITIMER_REAL, seconds)
            try:
                code = main(argv)
            except Overtime:
                code = "overtime"
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else 1
            except BaseException as caught:  # what main let through: a traceback
                import traceback

                err.write("".join(traceback.format_exception(caught)))
                code = "raised"
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        os.chdir(here)
    return {"code": code, "out": out.getvalue()[-4000:], "err": err.getvalue()[-8000:],
            "seconds": time.monotonic() - start, "memory": memory.peak - memory.base}


def serve() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
    signal.signal(signal.SIGALRM, _overtime)
    answers = os.fdopen(os.dup(1), "w")  # the commands' own stdout is captured
    for line in sys.stdin:
        request = json.loads(line)
        answer = run(request["argv"], request["cwd"], request["seconds"])
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    serve()
