"""Everything about on-line MegaScan lives here: the same detector as
``megatronapp detect`` (``evidence.detect``), fed each iteration's events as
the iteration completes, judging the last ``window`` iterations.

At each iteration's end the detector names its root causes over the window;
a small state machine per suspect turns ``confirm`` windows in a row into a
verdict and withdraws a verdict after ``clear`` windows without it.
Verdicts and withdrawals are ``Detection`` records, in the order they were
made. Nothing is read but the events (and the scenario's cost model, where
the run has one): each window is aligned from its own sync ops unless the
caller says its events are on one clock.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Literal

import numpy as np

from megatronapp.scenario.config import Scenario
from megatronapp.trace.columns import EventColumns, EventSource, concat_same

from megatronapp.scan.diagnosis import RootCause
from megatronapp.scan.align.inputs import DEFAULT_GPUS_PER_NODE, prepare_columns
from megatronapp.scan.evidence.detect import Detector
from megatronapp.scan.evidence.params import Params
from megatronapp.scan.online.online_config import SIMULATED, OnlineConfig
from megatronapp.scan.ingest.work import ModelledWork, job_of

__all__ = ["SIMULATED", "Detection", "OnlineConfig", "OnlineScan", "SuspectKey", "iterations_of"]

SuspectKey = tuple[str, int, int | None]  # (kind, rank, peer): what a verdict names


@dataclass(frozen=True)
class Detection:
    """One verdict (``event: named``) or withdrawal (``event: withdrawn``)."""

    event: Literal["named", "withdrawn"]
    kind: str  # compute | host | link
    rank: int
    peer: int | None
    confidence: float
    first_seen: int  # the iteration whose window first named it
    iteration: int  # the iteration at whose end this was decided
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> SuspectKey:
        return (self.kind, self.rank, self.peer)

    def to_json(self) -> dict[str, Any]:
        return {"event": self.event, "kind": self.kind, "rank": self.rank, "peer": self.peer,
                "confidence": round(self.confidence, 4), "first_seen": self.first_seen,
                "iteration": self.iteration, "evidence": self.evidence}

    def line(self) -> str:
        where = f"link {self.rank}-{self.peer}" if self.peer is not None else f"rank {self.rank}"
        if self.event == "withdrawn":
            return (f"iteration {self.iteration}: withdrawn {where} ({self.kind}): not seen for "
                    f"{self.evidence.get('windows_without', 0)} windows")
        blame = self.evidence.get("blame_s")
        cost = "" if blame is None else (
            f", {blame * 1e3:.3g} ms of each {self.evidence['iteration_s'] * 1e3:.3g} ms "
            f"iteration")
        return (f"iteration {self.iteration}: {where} is slow ({self.kind}{cost}, confidence "
                f"{self.confidence:.2f}, first seen at iteration {self.first_seen})")


@dataclass
class _Suspect:
    """A suspect's state: ``hits`` / ``misses`` are windows in a row with and
    without it; ``named`` once a verdict was made."""

    first_seen: int
    cause: RootCause
    hits: int = 0
    misses: int = 0
    named: bool = False


def _key(cause: RootCause) -> SuspectKey:
    return (cause.kind if cause.kind == "link" else "rank", cause.rank, cause.peer)


class OnlineScan:
    """Feed it each iteration's events (``feed``); it answers the detections
    that iteration's end decided. State: the detector's over the last
    ``window`` iterations, the suspects, and how often each was found."""

    def __init__(self, config: OnlineConfig = OnlineConfig(),
                 gpus_per_node: int = DEFAULT_GPUS_PER_NODE, scenario: Scenario | None = None,
                 params: Params = Params()):
        scenario = job_of(scenario)
        self.config = config
        self.gpus_per_node = gpus_per_node
        self.scenario = scenario
        self.detector = Detector(gpus_per_node, scenario, params,
                                 work=ModelledWork(scenario))  # the scenario's, for every window
        self._window: deque[int] = deque(maxlen=config.window)
        self._suspects: dict[SuspectKey, _Suspect] = {}
        self.found: dict[SuspectKey, int] = {}  # windows that named each rank or link
        self.records: list[Detection] = []
        self.iterations = 0

    @property
    def window_iterations(self) -> tuple[int, ...]:
        """The iterations MegaScan last looked at."""
        return tuple(self._window)

    @property
    def named(self) -> tuple[Detection, ...]:
        """The verdicts standing now (not withdrawn), in the order they were made."""
        standing = {k for k, s in self._suspects.items() if s.named}
        latest = {d.key: d for d in self.records}
        return tuple(d for d in self.records if d.event == "named" and _key_of(d) in standing
                     and latest[d.key] is d)

    def feed(self, iteration: int, cols: EventColumns) -> list[Detection]:
        """The events of one completed iteration; the detections it decided."""
        self.iterations += 1
        if len(cols):
            scan = prepare_columns(cols, aligned=self.config.aligned,
                                   gpus_per_node=self.gpus_per_node)
            self.detector.feed(replace(scan, scenario=self.scenario))
        self._window.append(iteration)
        self.detector.forget_before(self._window[0])
        causes = {_key(c): replace(c, evidence={**c.evidence,
                                               "window": [self._window[0], self._window[-1]]})
                  for c in self.detector.verdict().root_causes
                  if c.confidence >= self.config.min_confidence}
        decided = self._step(iteration, causes)
        self.records.extend(decided)
        return decided

    def _step(self, iteration: int, causes: dict[SuspectKey, RootCause]) -> list[Detection]:
        out: list[Detection] = []
        for key, cause in causes.items():
            self.found[key] = self.found.get(key, 0) + 1
            suspect = self._suspects.setdefault(key, _Suspect(iteration, cause))
            suspect.cause, suspect.hits, suspect.misses = cause, suspect.hits + 1, 0
            if not suspect.named and suspect.hits >= self.config.confirm:
                suspect.named = True
                out.append(self._detection("named", suspect, iteration))
        for key in [k for k in self._suspects if k not in causes]:
            suspect = self._suspects[key]
            suspect.hits, suspect.misses = 0, suspect.misses + 1
            if not suspect.named:
                del self._suspects[key]  # an unconfirmed finding leaves nothing behind
            elif suspect.misses >= self.config.clear:
                del self._suspects[key]
                out.append(self._detection("withdrawn", suspect, iteration))
        return out

    def _detection(self, event: Literal["named", "withdrawn"], suspect: _Suspect,
                   iteration: int) -> Detection:
        c = suspect.cause
        now = self.window_iterations
        where = {"window": [now[0], now[-1]]} if event == "withdrawn" and now else {}
        evidence = {**c.evidence, **where,
                    "windows_with": suspect.hits, "windows_without": suspect.misses,
                    "found_in_windows": self.found.get(_key(c), 0)}
        return Detection(event, c.kind, c.rank, c.peer, c.confidence, suspect.first_seen,
                         iteration, evidence)


def _key_of(d: Detection) -> SuspectKey:
    return (d.kind if d.kind == "link" else "rank", d.rank, d.peer)


def iterations_of(source: EventSource, compact: bool = False, max_rows: int = 1 << 23
                  ) -> Iterator[tuple[int, EventColumns]]:
    """A run's events one iteration at a time, in iteration order (events
    without an iteration are left out: they belong to none). ``compact``: only
    the rows the source holds, never expanded to every rank: in a reduced
    simulated run, one pipeline per class of identical pipelines (its other
    members' rows would repeat the same evidence; a faulty rank's pipeline is
    a class of its own). A source of more than ``max_rows`` events is read in
    passes over its batches, each keeping a block of iterations of about
    ``max_rows`` rows, so that a long run is never held whole."""
    if compact:
        yield from _by_iteration(concat_same([source.compact()[0]]))
    elif source.events <= max_rows:
        yield from _by_iteration(concat_same(list(source.batches())))
    else:
        yield from _in_blocks(source, max_rows)


def _by_iteration(cols: EventColumns) -> Iterator[tuple[int, EventColumns]]:
    order = np.argsort(cols.iteration, kind="stable")  # rows stay grouped by rank
    it = cols.iteration[order]
    cuts = np.r_[0, np.flatnonzero(np.diff(it)) + 1, len(it)]
    for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        if hi > lo and it[lo] >= 0:
            yield int(it[lo]), cols.take(order[lo:hi])


def _in_blocks(source: EventSource, max_rows: int) -> Iterator[tuple[int, EventColumns]]:
    """The first pass keeps iteration 0 and finds the last iteration; each
    later pass keeps as many iterations as fit in ``max_rows`` rows."""
    lo, hi, last = 0, 1, 0
    while lo <= last:
        kept = []
        for batch in source.batches():
            last = max(last, int(batch.iteration.max(initial=-1)))
            kept.append(batch.take(np.flatnonzero((batch.iteration >= lo)
                                                  & (batch.iteration < hi))))
        yield from _by_iteration(concat_same(kept))
        per_pass = max(1, max_rows * (last + 1) // max(source.events, 1))
        lo, hi = hi, hi + per_pass
