"""MegaScan's capture side: per-rank event buffers and Chrome trace output.

A backend records each operation as (name, start, duration, args) in *true*
seconds (the simulator's clock, or the host's monotonic clock). A rank's
``RankClock`` maps true time to that rank's local clock: raw per-rank files are
written in local time, the merged ``trace.json`` in aligned (true) time.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from .kinds import event_kind
from .sections import FbdSection, ScopeSection, TrainingSection, summary_sections
from ..parallel.topology import Topology

if TYPE_CHECKING:
    from .columns import EventSource  # columns reads events: typing only

# Chrome "tid" lanes so Perfetto draws compute, p2p and collectives apart
# (annotations of other kinds share the compute lane).
LANES = {"compute": 0, "p2p": 1, "collective": 2}


@dataclass(frozen=True)
class RankClock:
    """local = true·(1 + drift) + offset; the simulator's injected skew."""

    offset_us: float = 0.0
    drift_ppm: float = 0.0

    def local(self, true_s: float) -> float:
        return true_s * (1.0 + self.drift_ppm * 1e-6) + self.offset_us * 1e-6


@dataclass(frozen=True, slots=True)
class Event:
    name: str
    start_s: float
    dur_s: float
    args: Mapping[str, Any]

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s


@dataclass
class Tracer:
    """Buffers one rank's events (``now`` is the backend's clock)."""

    rank: int
    now: Callable[[], float] = time.perf_counter
    on_record: Callable[[int, Event], None] | None = None
    events: list[Event] = field(default_factory=list)

    def record(self, name: str, start_s: float, end_s: float, args: Mapping[str, Any]) -> None:
        event = Event(name, start_s, end_s - start_s, args)
        self.events.append(event)
        if self.on_record is not None:
            self.on_record(self.rank, event)


# ------------------------------------------------------------------ output


def chrome_events(rank: int, label: str, events: list[Event],
                  to_time: Callable[[float], float]) -> list[dict[str, Any]]:
    """Complete ("X") events in µs for one process, plus its name metadata."""
    out: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": label}},
        {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
         "args": {"sort_index": rank}},
    ]
    for lane, tid in LANES.items():
        out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                    "args": {"name": lane}})
    for e in events:
        start = to_time(e.start_s)
        cat = event_kind(e.name, e.args)
        out.append({"ph": "X", "name": e.name, "cat": cat, "pid": rank, "tid": LANES.get(cat, 0),
                    "ts": round(start * 1e6, 3),
                    "dur": round((to_time(e.end_s) - start) * 1e6, 3),
                    "args": dict(e.args)})
    return out


def write_json(path: Path, data: Any) -> None:
    with open(path, "w") as fh:
        json.dump(data, fh, separators=(",", ":"), allow_nan=False)  # always valid JSON


@dataclass
class RunResult:
    """What a backend hands back: events in true time plus what it knows.

    ``source`` (when set) holds the events as columns, possibly compact (one
    simulated pipeline per class of identical ones); ``events`` is then a
    view that builds ``Event`` objects rank by rank on demand. The sections
    (``trace.sections``) are set by the runs that have them."""

    backend: str
    topo: Topology
    events: Mapping[int, list[Event]]
    clocks: dict[int, RankClock]
    source: EventSource | None = None
    fbd: FbdSection | None = None  # a decoupled (MegaFBD) run
    training: TrainingSection | None = None  # a real run's losses
    scope: ScopeSection | None = None  # MegaScope's capture, or its predicted overhead
    checkpoint: str | None = None  # the run directory's checkpoint folder, when saved
    # the closed loop's accounting (megatronapp.mitigate.loop.Loop.to_json), on its first segment
    mitigation: dict[str, Any] | None = None
    stopped: dict[str, Any] | None = None  # a fail-stop fault ended the job early: which, when

    def label(self, rank: int) -> str:
        return self.topo.label(rank)

    def summary_items(self) -> dict[str, Any]:
        """What the sections add to summary.json, in order."""
        return summary_sections(self.fbd, self.training, self.scope, self.checkpoint,
                                self.mitigation, self.stopped)


# A backend's entry point as harnesses receive it (validation, speed, sweeps).
RunScenario = Callable[[Any], RunResult]
