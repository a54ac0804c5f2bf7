"""What ``run --detect`` and a scenario's ``mitigation:`` section add to a run:
on-line MegaScan beside it (live on real ranks, iteration by iteration on the
simulator), ``RUN_DIR/detections.jsonl``, and the closed loop's segments."""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from megatronapp.errors import UserError
from megatronapp.program.backend import RunOptions, StopRequest
from megatronapp.scan.online.live import (DETECTIONS_FILE, DetectionLog, LiveFeed, detect_iterations,
                                   reporter, scan_for)
from megatronapp.scan.online.online import SIMULATED, Detection, iterations_of
from megatronapp.faults import effects_of
from megatronapp.scenario.config import Mitigation, Scenario, fault_job
from megatronapp.trace.columns import source_of
from megatronapp.trace.events import Event, RunResult

from .loop import RunFn, Segment, Watch, close_loop, summary_lines
from .plan import replan

__all__ = ["OnlineRun", "check_online", "loops"]


def loops(s: Scenario) -> bool:
    """Whether the scenario's mitigation acts (the closed loop): on verdicts, or
    restarting a job a fail-stop fault stops."""
    if s.mitigation is None:
        return False
    return s.mitigation.action != "none" or effects_of(s.faults, fault_job(s)).stop is not None


def check_online(s: Scenario, detect: bool) -> None:
    """Refused before anything runs: one line naming the option."""
    if detect and s.fbd is not None:
        raise UserError("--detect: decoupled (fbd) runs are not scanned on-line")


class SegmentWatch:
    """The loop beside one segment of a job on real ranks: on-line MegaScan fed
    as the ranks report, and a stop asked at once when a verdict is due that
    the loop can act on (a plan fits without its node)."""

    def __init__(self, job: Scenario, segment: Scenario, restarts: int):
        self.job, self.segment, self.restarts = job, segment, restarts
        self.done = job.iterations - segment.iterations  # the checkpoint it resumed from
        self.scan = scan_for(segment, live=True)
        self.watch = Watch(self.scan, segment.mitigation or Mitigation(), segment)
        self.feed = LiveFeed(self.scan, segment.world_size, self._decided)
        self.request = StopRequest()
        self.verdict: Detection | None = None

    def _decided(self, decided: list[Detection]) -> None:
        iteration = self.scan.window_iterations[-1]
        verdict = self.watch.acts(iteration, decided, self.restarts, self.done,
                                  self.job.iterations)
        if verdict is not None and self.verdict is None and self._plan_fits(verdict):
            self.verdict, self.request.requested = verdict, True

    def _plan_fits(self, verdict: Detection) -> bool:
        try:
            replan(self.segment, verdict.rank, 0.0)
        except UserError:
            return False  # no plan fits what is left: the job runs on
        return True

    def options(self, base: RunOptions) -> RunOptions:
        policy = self.segment.mitigation or Mitigation()
        return replace(base, checkpoint_every=policy.checkpoint_every,
                       resume_iteration=self.done, stop=self.request)

    def stopped(self) -> tuple[Detection, int] | None:
        """The verdict the segment stopped on and its last iteration; None if it
        ran to its end (asked too late to stop before it)."""
        last = self.request.stopped_after
        if self.verdict is None or last is None or last + 1 >= self.segment.iterations:
            return None
        return self.verdict, last


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
                             self.report) if self.live and not loops(self.scenario) else None
        self.segments: list[Segment] = []
        self.watches: list[SegmentWatch] = []  # the loop on real ranks: one per segment run

    @classmethod
    def wanted(cls, s: Scenario, detect: bool, out_dir: Path, as_json: bool,
               live: bool) -> "OnlineRun | None":
        return cls(s, out_dir, as_json, live) if detect or loops(s) else None

    def tee(self, record: Callable[[int, Event], None]) -> Callable[[int, Event], None]:
        """The backend's event hook: ``record``, and the live feed when there is
        one (the loop's: that of the segment running now)."""
        if self.feed is not None:
            return self.feed.tee(record)
        if not (self.live and loops(self.scenario)):
            return record

        def both(rank: int, event: Event) -> None:
            record(rank, event)
            self.watches[-1].feed.record(rank, event)
        return both

    def options(self, segment: Scenario, base: RunOptions) -> RunOptions:
        """How to run ``segment`` (the job, or a re-planned rest of it): on real
        ranks with the loop, watched, checkpointed and resumed from the last checkpoint."""
        if not (self.live and loops(self.scenario)):
            return base
        self.watches.append(SegmentWatch(self.scenario, segment, len(self.watches)))
        return self.watches[-1].options(base)

    def after(self, result: RunResult, run: RunFn) -> list[Segment]:
        """Once the backend is done: the rest of the scan, and the closed loop's
        segments (the first one's summary holds the loop's accounting), if it acts."""
        if self.feed is not None:
            self.feed.finish()
        elif not loops(self.scenario):
            detect_iterations(scan_for(self.scenario, SIMULATED),
                              iterations_of(source_of(result)), self.report)
        else:  # real ranks stopped themselves: their iterations scanned again for the record
            loop = close_loop(self.scenario, result, run, self.report,
                              scan_for(self.scenario, None if self.live else SIMULATED,
                                       live=self.live).config,
                              live=(lambda: self.watches[-1].stopped()) if self.live else None)
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
