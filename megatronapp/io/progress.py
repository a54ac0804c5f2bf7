"""Progress on stderr for commands that take more than a second.

Each display says what is being done (``loading 1024 rank files``,
``spawning 4 ranks``, ``iteration 3/10, loss 2.914``). Displays are drawn only
when stderr is a terminal, so pipes, files and tests stay clean, and rich is
imported only then. Work reports its phases through a ``Say`` callback, so
the core never knows whether anyone is watching.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

Say = Callable[[str], None]


def quiet(_text: str) -> None:
    """A ``Say`` that shows nothing."""


def shown(enabled: bool | None = None) -> bool:
    return sys.stderr.isatty() if enabled is None else enabled


def _console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


@contextmanager
def status(first: str, enabled: bool | None = None) -> Iterator[Say]:
    """A spinner on stderr with one line of text; yields what updates it."""
    if not shown(enabled):
        yield quiet
        return
    with _console().status(first) as spinner:
        yield lambda text: spinner.update(text)


@contextmanager
def counter(description: str, total: int,
            enabled: bool | None = None) -> Iterator[Callable[[], None]]:
    """A bar counting ``total`` steps; yields what advances it by one."""
    if not shown(enabled):
        yield lambda: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn(f"[bold]{description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), transient=True, console=_console())
    task = bar.add_task(description, total=total)
    with bar:
        yield lambda: bar.advance(task)


class RunProgress:
    """``megatronapp run``: the backend's phase (``spawning 4 ranks``, ``building
    stages``), then iterations as rank 0 finishes them, with the latest loss
    a rank reports at its optimizer step."""

    def __init__(self, iterations: int, enabled: bool | None = None):
        self.iterations, self.done, self.loss = iterations, 0, ""
        self.operations_done = 0
        self.description = "starting"
        self._bar: Any = None
        if shown(enabled):
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                 TimeElapsedColumn(), transient=True, console=_console())
            self._task = self._bar.add_task("starting", total=iterations)

    def __enter__(self) -> RunProgress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()

    def phase(self, text: str) -> None:
        self.description = text
        if self._bar is not None:
            self._bar.update(self._task, description=text)

    def record(self, rank: int, event: Any) -> None:
        """The backend's ``on_record`` hook."""
        if event.name != "optimizer":
            return
        if "loss" in event.args:
            self.loss = f", loss {event.args['loss']:.3f}"
        if rank == 0:
            self.done += 1
        self.phase(f"iteration {self.done}/{self.iterations}{self.loss}")
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)

    def operations(self, done: int, total: int) -> None:
        """The backend's ``progress`` hook: operations simulated since the last call."""
        self.operations_done += done
        self.phase(f"simulating: {self.operations_done:,}/{total:,} operations")
        if self._bar is not None:
            self._bar.update(self._task, completed=self.operations_done, total=total)

    def counted(self, text: str, total: int, unit: str) -> Callable[[int], None]:
        """A phase counting ``total`` things (``writing trace.parquet``, rows);
        returns what advances it."""
        self.phase(f"{text} ({total:,} {unit})")
        if self._bar is None:
            return lambda _n: None
        bar, task = self._bar, self._task
        bar.reset(task, total=total, description=self.description)
        return lambda n: bar.advance(task, n)
