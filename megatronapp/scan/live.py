"""On-line MegaScan beside a run (``megatronapp run --detect``): each iteration's
events go to ``OnlineScan`` in order, each verdict or withdrawal is said at
once and appended to ``RUN_DIR/detections.jsonl`` (one JSON record a line).

The file is written inside the run's staging folder, so it is published with
the run, whole, or not at all (docs/robustness.md).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

from megatronapp.errors import UserError
from megatronapp.scenario.config import Scenario
from megatronapp.trace.columns import EventColumns

from .online import Detection, OnlineConfig, OnlineScan

__all__ = ["DETECTIONS_FILE", "DetectionLog", "Report", "detect_iterations", "reporter", "scan_for"]

DETECTIONS_FILE = "detections.jsonl"


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


def scan_for(s: Scenario, config: OnlineConfig = OnlineConfig()) -> OnlineScan:
    """The on-line detector for a run of ``s`` (its node size, its model for the work of
    ranks without stage peers)."""
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
