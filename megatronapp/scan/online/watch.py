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
from megatronapp.io import gate
from megatronapp.trace.columns import EventColumns, TableSource, columns_from_events, is_int32
from megatronapp.trace.store import TRACE_FILE, StoreError, read_columns

from megatronapp.scan.align.inputs import DEFAULT_GPUS_PER_NODE
from megatronapp.scan.ingest.kineto import is_kineto, kineto_files, load_kineto, read_json_any
from megatronapp.scan.online.live import on_device
from megatronapp.scan.ingest.load import TraceError
from megatronapp.scan.online.online import OnlineConfig, OnlineScan, iterations_of

__all__ = ["CycleFollower", "WatchState", "follow"]

Iterations = list[tuple[int, EventColumns]]


SETTLE_S = 10.0  # a file unchanged this long that still does not parse is not being written


@dataclass
class CycleFollower:
    """Kineto files of a directory, grouped into cycles: per rank the files not
    yet read, oldest first; a cycle is one file of every rank. A file that does
    not parse is read again only once it has changed (size or time), and one
    unchanged for ``SETTLE_S`` is no trace (``unparsed``)."""

    directory: Path
    world_size: int | None = None
    rank_of: dict[Path, int] = field(default_factory=dict)  # files parsed once
    read: set[Path] = field(default_factory=set)
    # files that did not parse: (size, mtime) then, when first seen so, why
    failed: dict[Path, tuple[tuple[int, int], float, str]] = field(default_factory=dict)

    def _rank(self, path: Path) -> int | None:
        """The file's rank, or None while it does not parse (still being written)."""
        if path not in self.rank_of:
            stamp = _stamp(path)
            seen = self.failed.get(path)
            if seen is not None and seen[0] == stamp:  # not changed since: not read again
                return None
            try:
                data = read_json_any(path)
            except TraceError as err:
                self.failed[path] = (stamp, time.monotonic(), str(err))
                return None
            self.failed.pop(path, None)
            if not is_kineto(data) or not isinstance(data.get("distributedInfo"), dict):
                raise UserError(f"DIR: {path} is not a torch.profiler trace of a distributed job")
            self.rank_of[path] = self._place(path, data["distributedInfo"])
        return self.rank_of[path]

    def _place(self, path: Path, info: dict) -> int:
        """The file's rank, checked against the job's world size (one line naming the field)."""
        world = info.get("world_size", 1)
        rank = info.get("rank", 0)
        for name, value, low in (("world_size", world, 1), ("rank", rank, 0)):
            if not is_int32(value) or value < low:
                raise UserError(f"DIR: {path}: distributedInfo.{name} must be an integer >= "
                                f"{low}, got {value!r:.40}")
        if self.world_size is not None and world != self.world_size:
            raise UserError(f"DIR: {path}: distributedInfo.world_size is {world}, the other "
                            f"files' {self.world_size}")
        if rank >= world:
            raise UserError(f"DIR: {path}: distributedInfo.rank {rank} is not below its "
                            f"world_size {world}")
        self.world_size = world
        return int(rank)

    def unparsed(self, settled_s: float = SETTLE_S) -> str | None:
        """A file that has not changed for ``settled_s`` and still does not parse: why."""
        now = time.monotonic()
        for path, (stamp, since, why) in sorted(self.failed.items()):
            if now - since >= settled_s and _stamp(path) == stamp:
                return f"DIR: {why} (unchanged for {now - since:.0f} s: not a file being written)"
        return None

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


def _stamp(path: Path) -> tuple[int, int]:
    """(size, mtime): what changes while a file is written."""
    try:
        st = path.stat()
    except OSError:
        return -1, -1
    return st.st_size, st.st_mtime_ns


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
    if not gate.exists(directory, "DIR", "any") or not directory.is_dir():
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
        if not directory.is_dir():
            raise UserError(f"DIR: {directory} was removed while it was watched")
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
        garbage = follower.unparsed(min(SETTLE_S, idle_s or SETTLE_S))
        if garbage is not None:
            raise UserError(garbage)
        left = None if idle_s is None else idle_s - (time.monotonic() - last_change)
        time.sleep(interval_s if left is None else max(0.0, min(interval_s, left)))
    garbage = follower.unparsed(0.0)  # nothing was written for idle_s: every file is whole
    if garbage is not None:
        raise UserError(garbage)
    if scan is None:
        _nothing_to_read(directory)
    return scan if scan is not None else OnlineScan(config)


def _nothing_to_read(directory: Path) -> None:
    """A watch that read nothing from a folder of other files says so."""
    others = sorted(p.name for p in directory.iterdir() if p.is_file())
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise UserError(f"DIR: {directory} holds no torch.profiler traces "
                        f"(*.pt.trace.json[.gz]), only {shown}")
