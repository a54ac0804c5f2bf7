"""On-line MegaScan beside a run (``megatronapp run --detect``): each iteration's
events go to ``OnlineScan`` in order, each verdict or withdrawal is said at
once and appended to ``RUN_DIR/detections.jsonl`` (one JSON record a line).

The file is written inside the run's staging folder, so it is published with
the run, whole, or not at all (docs/robustness.md).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from megatronapp.errors import UserError
from megatronapp.scenario.config import Scenario
from megatronapp.trace.columns import EventColumns, columns_from_events
from megatronapp.trace.events import Event

from megatronapp.scan.online.online import SIMULATED, Detection, OnlineConfig, OnlineScan
from megatronapp.scan.align.table import COMPUTE_KIND

__all__ = ["DETECTIONS_FILE", "QUEUED", "DetectionLog", "LiveFeed", "Report",
           "detect_iterations", "on_device", "reporter", "scan_for"]

DETECTIONS_FILE = "detections.jsonl"
# The arg a CPU rank puts on each compute op: the seconds its thread waited to
# run while the op ran (other processes had the cores).
QUEUED = "queued_s"


def on_device(cols: EventColumns) -> EventColumns:
    """``cols`` with each compute op's duration less its ``QUEUED`` wait: the
    time the op held the device, as a GPU kernel's time is. On a shared CPU a
    healthy rank is descheduled at random moments and its ops' wall times say
    more about the machine's load than about the rank."""
    if cols.extra is None:
        return cols
    rows = np.flatnonzero((cols.kind == COMPUTE_KIND) & (cols.extra != None))  # noqa: E711
    queued = np.array([float(json.loads(cols.extra[r]).get(QUEUED, 0.0)) for r in rows])
    if not queued.any():
        return cols
    dur = cols.dur_s.copy()
    dur[rows] = np.maximum(dur[rows] - queued, 0.0)
    return replace(cols, dur_s=dur)


class DetectionLog:
    """Appends detections to a JSON-lines file, one record a line, flushed as
    each is made (a reader following the file sees each verdict at once)."""

    def __init__(self, path: Path):
        self.path = path
        self.written = 0
        try:
            path.touch()  # no detection is a result too: an empty log
        except OSError as err:
            raise UserError(f"--out: cannot write {path}: {err.strerror or err}") from None

    def append(self, detections: Iterable[Detection]) -> None:
        lines = "".join(json.dumps(d.to_json(), allow_nan=False) + "\n" for d in detections)
        if not lines:
            return
        try:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(lines)
        except OSError as err:
            raise UserError(f"--out: cannot write {self.path}: {err.strerror or err}") from None
        self.written += lines.count("\n")


def scan_for(s: Scenario, config: OnlineConfig | None = None, live: bool = False
             ) -> OnlineScan:
    """The on-line detector for a run of ``s``: its node size and its cost
    model (for the work of ranks without peers), never its faults. ``live``:
    events as real ranks record them, each on its own clock, so each window
    is aligned; otherwise ``config`` (default: the simulator's one clock)."""
    if config is None:
        config = OnlineConfig() if live else SIMULATED
    return OnlineScan(config, gpus_per_node=s.cluster.gpus_per_node, scenario=s)


Report = Callable[[list[Detection]], None]


def reporter(log: DetectionLog, say: Callable[[str], None]) -> Report:
    """What to do with the detections an iteration decided: log each, say each."""
    def report(decided: list[Detection]) -> None:
        log.append(decided)
        for d in decided:
            say(d.line())
    return report


def detect_iterations(scan: OnlineScan, iterations: Iterable[tuple[int, EventColumns]],
                      report: Report) -> list[Detection]:
    """Feed iterations in order; report each iteration's detections as they are decided."""
    made: list[Detection] = []
    for iteration, cols in iterations:
        decided = scan.feed(iteration, cols)
        report(decided)
        made += decided
    return made


class LiveFeed:
    """Events as a backend records them (``RunHooks.events``: real ranks report
    each as it ends) made into whole iterations: iteration i goes to the
    detector once every rank has recorded an event of a later iteration, so a
    verdict comes while the job runs; ``finish`` feeds what is left. Only the
    iterations not yet fed are held."""

    def __init__(self, scan: OnlineScan, world_size: int, report: Report):
        self.scan, self.world_size, self.report = scan, world_size, report
        self._pending: dict[int, dict[int, list[Event]]] = {}  # iteration -> rank -> events
        self._latest: dict[int, int] = {}  # rank -> the latest iteration it reported
        self.fed: list[int] = []

    def record(self, rank: int, event: Event) -> None:
        iteration = event.args.get("iteration")
        if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
            return  # set-up and annotations belong to no iteration
        self._pending.setdefault(iteration, {}).setdefault(rank, []).append(event)
        self._latest[rank] = max(self._latest.get(rank, iteration), iteration)
        if len(self._latest) == self.world_size:
            self._feed_before(min(self._latest.values()))

    def finish(self) -> None:
        self._feed_before(None)

    def tee(self, other: Callable[[int, Event], None]) -> Callable[[int, Event], None]:
        """A ``RunHooks.events`` that hands each event to ``other`` and to this feed."""
        def both(rank: int, event: Event) -> None:
            other(rank, event)
            self.record(rank, event)
        return both

    def _feed_before(self, end: int | None) -> None:
        for iteration in sorted(i for i in self._pending if end is None or i < end):
            events = self._pending.pop(iteration)
            self.report(self.scan.feed(iteration, on_device(columns_from_events(events))))
            self.fed.append(iteration)
