"""Everything about following a directory a job is writing (``megatronapp watch``)
lives here.

Two kinds of directory: this project's run directory (published whole when its
job ends: its iterations are read in order, then the watch ends), and a
directory torch.profiler's ``tensorboard_trace_handler`` writes into (one file
per rank per profiling cycle, named by host, process and time). A cycle is
read once every rank has a file for it; a file still being written does not
parse yet and is tried again at the next poll. Each cycle's iterations
(``ProfilerStep#N``) go to ``OnlineScan`` in order.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

from megatronapp.errors import UserError
from megatronapp.trace.columns import EventColumns, TableSource, columns_from_events
from megatronapp.trace.store import TRACE_FILE, StoreError, read_columns

from megatronapp.scan.align.inputs import DEFAULT_GPUS_PER_NODE
from megatronapp.scan.ingest.kineto import is_kineto, kineto_files, load_kineto, read_json_any
from megatronapp.scan.online.live import on_device
from megatronapp.scan.ingest.load import TraceError
from megatronapp.scan.online.online import OnlineConfig, OnlineScan, iterations_of

__all__ = ["CycleFollower", "WatchState", "follow"]

Iterations = list[tuple[int, EventColumns]]


@dataclass
class CycleFollower:
    """Kineto files of a directory, grouped into cycles: per rank the files not
    yet read, oldest first; a cycle is one file of every rank."""

    directory: Path
    world_size: int | None = None
    rank_of: dict[Path, int] = field(default_factory=dict)  # files parsed once
    read: set[Path] = field(default_factory=set)

    def _rank(self, path: Path) -> int | None:
        """The file's rank, or None while it does not parse (still being written)."""
        if path not in self.rank_of:
            try:
                data = read_json_any(path)
            except TraceError:
                return None
            if not is_kineto(data) or not isinstance(data.get("distributedInfo"), dict):
                raise UserError(f"DIR: {path} is not a torch.profiler trace of a distributed job")
            info = data["distributedInfo"]
            self.rank_of[path] = int(info.get("rank", 0))
            self.world_size = self.world_size or int(info.get("world_size", 1))
        return self.rank_of[path]

    def ready_cycles(self) -> Iterator[list[Path]]:
        """Each cycle every rank has written (files of a rank in the order written)."""
        pending: dict[int, list[Path]] = {}
        for path in sorted((p for p in kineto_files(self.directory) if p not in self.read),
                           key=_written_order):
            rank = self._rank(path)
            if rank is not None:
                pending.setdefault(rank, []).append(path)
        while self.world_size and all(pending.get(r) for r in range(self.world_size)):
            cycle = [pending[r].pop(0) for r in range(self.world_size)]
            self.read.update(cycle)
            yield cycle

    def unread(self) -> tuple[tuple[str, int], ...]:
        """The files not read yet, with their sizes: a change means the job is writing."""
        return tuple((p.name, _size(p)) for p in kineto_files(self.directory)
                     if p not in self.read)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _written_order(path: Path) -> tuple[int, str]:
    try:
        return path.stat().st_mtime_ns, path.name
    except OSError:  # gone since it was listed
        return 0, path.name


def cycle_iterations(paths: list[Path]) -> tuple[Iterations, bool]:
    """A cycle's iterations, and whether its files share one clock (one host)."""
    job = load_kineto(paths)
    cols = columns_from_events(job.events)
    return list(iterations_of(TableSource(cols))), job.one_clock


def run_iterations(run_dir: Path) -> tuple[Iterations, int]:
    """A finished run directory's iterations (true times, each compute op's
    time on its device: ``on_device``, as ``run --detect`` judged them) and
    its node size."""
    try:
        cols, meta = read_columns(run_dir / TRACE_FILE, with_args=True)  # the ops' queued_s
    except StoreError as err:
        raise UserError(f"DIR: {err}") from None
    gpus = int(meta.extra.get("topology", {}).get("gpus_per_node", DEFAULT_GPUS_PER_NODE))
    return list(iterations_of(TableSource(on_device(cols)))), gpus


@dataclass
class WatchState:
    """What the progress line says."""

    cycles: int = 0
    iterations: int = 0
    standing: int = 0
    waiting: int = 0

    def line(self, directory: Path) -> str:
        return (f"watching {directory}: {self.cycles} cycles, {self.iterations} iterations read, "
                f"{self.standing} verdicts standing, {self.waiting} files waiting")


Feed = Callable[[OnlineScan, Iterations], None]


def follow(directory: Path, config: OnlineConfig, feed: Feed, progress: Callable[[str], None],
           interval_s: float = 1.0, idle_s: float | None = None) -> OnlineScan:
    """Follow ``directory`` until its job ends: a run directory at once; a
    profiler directory when no new file came for ``idle_s`` (None: until
    interrupted). ``feed`` hands iterations to the detector and reports."""
    if not directory.is_dir():
        raise UserError(f"DIR: {directory} is not a directory")
    if (directory / TRACE_FILE).is_file():
        iterations, gpus = run_iterations(directory)
        finished = OnlineScan(config, gpus_per_node=gpus)
        feed(finished, iterations)
        return finished
    follower, state = CycleFollower(directory), WatchState()
    scan: OnlineScan | None = None
    unread: tuple[tuple[str, int], ...] = ()
    last_change = time.monotonic()
    while idle_s is None or time.monotonic() - last_change < idle_s:
        for cycle in follower.ready_cycles():
            iterations, one_clock = cycle_iterations(cycle)
            scan = scan or OnlineScan(replace(config, aligned=one_clock))
            feed(scan, iterations)
            state.cycles, state.iterations = state.cycles + 1, scan.iterations
            state.standing, last_change = len(scan.named), time.monotonic()
        now_unread = follower.unread()
        if now_unread != unread:  # a new file, or one growing: the job is alive
            unread, last_change = now_unread, time.monotonic()
        state.waiting = len(unread)
        progress(state.line(directory))
        time.sleep(interval_s)
    return scan if scan is not None else OnlineScan(config)
