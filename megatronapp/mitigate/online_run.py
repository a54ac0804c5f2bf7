"""What ``run --detect`` and a scenario's ``mitigation:`` section add to a run:
on-line MegaScan beside it (live on real ranks, iteration by iteration on the
simulator), ``RUN_DIR/detections.jsonl``, and the closed loop's segments."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from megatronapp.errors import UserError
from megatronapp.scan.live import (DETECTIONS_FILE, DetectionLog, LiveFeed, detect_iterations,
                                   reporter, scan_for)
from megatronapp.scan.online import iterations_of
from megatronapp.scenario.config import Scenario
from megatronapp.trace.columns import source_of
from megatronapp.trace.events import Event, RunResult

from .loop import RunFn, Segment, close_loop, summary_lines

__all__ = ["OnlineRun", "check_online", "loops"]


def loops(s: Scenario) -> bool:
    """Whether the scenario's mitigation acts on verdicts (the closed loop)."""
    return s.mitigation is not None and s.mitigation.action != "none"


def check_online(s: Scenario, detect: bool, backend: str) -> None:
    """Refused before anything runs: one line naming the option."""
    if detect and s.fbd is not None:
        raise UserError("--detect: decoupled (fbd) runs are not scanned on-line")
    if loops(s) and backend != "sim":
        raise UserError(f"mitigation: the closed loop restarts simulated jobs only, not on the "
                        f"{backend} backend (action: none, or --backend sim)")


def _say(as_json: bool) -> Callable[[str], None]:
    """Detection lines go to stdout, or to stderr when stdout holds JSON."""
    return (lambda line: print(line, file=sys.stderr)) if as_json else print


@dataclass
class OnlineRun:
    """On-line MegaScan of one run writing into ``out_dir`` (its staging folder).
    ``live``: the backend's ranks report events as they run (they are scanned
    then); else the finished run is fed iteration by iteration."""

    scenario: Scenario
    out_dir: Path
    as_json: bool
    live: bool

    def __post_init__(self) -> None:
        self.log = DetectionLog(self.out_dir / DETECTIONS_FILE)
        self.report = reporter(self.log, _say(self.as_json))
        self.feed = LiveFeed(scan_for(self.scenario, live=True), self.scenario.world_size,
                             self.report) if self.live else None
        self.segments: list[Segment] = []

    @classmethod
    def wanted(cls, s: Scenario, detect: bool, out_dir: Path, as_json: bool,
               live: bool) -> "OnlineRun | None":
        return cls(s, out_dir, as_json, live and not loops(s)) if detect or loops(s) else None

    def tee(self, record: Callable[[int, Event], None]) -> Callable[[int, Event], None]:
        """The backend's event hook: ``record``, and the live feed when there is one."""
        return record if self.feed is None else self.feed.tee(record)

    def after(self, result: RunResult, run: RunFn) -> list[Segment]:
        """Once the backend is done: the rest of the scan, and the closed loop's
        segments (the first one's summary holds the loop's accounting), if it acts."""
        if self.feed is not None:
            self.feed.finish()
        elif not loops(self.scenario):
            detect_iterations(scan_for(self.scenario), iterations_of(source_of(result)),
                              self.report)
        else:
            loop = close_loop(self.scenario, result, run, self.report)
            loop.segments[0].result.mitigation = loop.to_json()
            self.segments = list(loop.segments)
        return self.segments

    def lines(self, out: Path, summary: dict[str, Any]) -> list[str]:
        """What ``run`` prints after its summary."""
        lines = [f"  wrote {out / DETECTIONS_FILE} ({self.log.written} detections)"]
        if self.segments:
            lines += summary_lines(summary["mitigation"],
                                   [f"{out}/segment{j}/" for j in range(1, len(self.segments))])
        return lines
