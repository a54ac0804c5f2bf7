"""On-line MegaScan beside a run (``megatronapp run --detect``): each iteration's
events go to ``OnlineScan`` in order, each verdict or withdrawal is said at
once and appended to ``RUN_DIR/detections.jsonl`` (one JSON record a line).

The file is written inside the run's staging folder, so it is published with
the run, whole, or not at all (docs/robustness.md).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import NormalDist
from typing import Callable, Iterable

import numpy as np

from megatronapp.errors import UserError
from megatronapp.scenario.config import Scenario
from megatronapp.trace.columns import KINDS, EventColumns, columns_from_events
from megatronapp.trace.events import Event

from .components import classes_of
from .detect import STAGE_PEER_WORDS
from .diagnosis import RootCause
from .inputs import DEFAULT_GPUS_PER_NODE
from .online import Detection, OnlineConfig, OnlineScan, SuspectKey

__all__ = ["DETECTIONS_FILE", "LIVE_CONFIRM", "DetectionLog", "LiveFeed", "LiveScan", "Report",
           "SlowdownTest", "detect_iterations", "fastest_log_ratios", "reporter", "scan_for",
           "stage_classes"]

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


# Real ranks on a shared machine: a rank descheduled for a couple of
# iterations looks throttled to two windows in a row; a third window tells
# them apart (links, and ranks without stage peers: those with peers are
# judged by ``SlowdownTest``).
LIVE_CONFIRM = 3

COMPUTE, COLLECTIVE = KINDS.index("compute"), KINDS.index("collective")


def stage_classes(cols: EventColumns) -> dict[int, tuple[int, ...]]:
    """rank -> the ranks that run its compute (those its TP and DP collectives join)."""
    words = np.array([n.lower().split("_")[0] in STAGE_PEER_WORDS for n in cols.names] + [False])
    rows = np.flatnonzero((cols.kind == COLLECTIVE) & words[cols.name.astype(np.int64)])
    members = [cols.groups[g] for g in np.unique(cols.group[rows]).tolist() if g >= 0]
    a = [m[i] for m in members for i in range(len(m) - 1)]
    b = [m[i + 1] for m in members for i in range(len(m) - 1)]
    ranks = np.unique(np.r_[cols.rank, np.array(a + b, np.int64)].astype(np.int64))
    return classes_of(ranks, np.array(a, np.int64), np.array(b, np.int64))


def fastest_log_ratios(cols: EventColumns, peers: dict[int, tuple[int, ...]]
                       ) -> dict[int, float]:
    """Each rank's compute in one iteration against its stage peers': per op
    name it ran more than once, the log of its fastest op over the median of
    its peers' fastest, averaged over the names all of them ran so. On a
    shared machine time spent descheduled stretches an op now and then; the
    fastest of the repeated ops is the one least stretched, and a slow device
    stretches every one."""
    compute = cols.kind == COMPUTE
    out: dict[int, float] = {}
    for cls in {c for c in peers.values() if len(c) > 1}:
        fastest: dict[int, dict[int, float]] = {}
        for r in cls:
            mine = compute & (cols.rank == r) & (cols.dur_s > 0)
            names, dur = cols.name[mine], cols.dur_s[mine]
            codes, counts = np.unique(names, return_counts=True)
            fastest[r] = {int(n): float(dur[names == n].min())
                          for n in codes[counts > 1]}  # one op is no fastest of several
        shared = set.intersection(*(set(f) for f in fastest.values()))
        if not shared:
            continue
        for r in cls:
            out[r] = float(np.mean([math.log(fastest[r][n] / float(np.median(
                [fastest[p][n] for p in cls if p != r]))) for n in sorted(shared)]))
    return out


# The sequential test: a rank is named once the log-likelihood ratio, summed
# over iterations (a CUSUM, restarting at 0), that its compute is
# LIVE_SLOWDOWN times its stage peers' rather than as fast reaches
# LIVE_THRESHOLD: a steady 1.5x slowdown (0.91 a iteration) is named in its
# fifth iteration. LIVE_NOISE_SD: about the spread of healthy ranks'
# ``fastest_log_ratios`` on kept torch runs of 4 ranks on 2 loaded cores.
LIVE_SLOWDOWN = 1.5
LIVE_THRESHOLD = 4.0
LIVE_NOISE_SD = 0.3


@dataclass
class SlowdownTest:
    """Per rank, the CUSUM of per-iteration log-likelihood ratios (slowed by
    ``slowdown`` against as fast as its peers, Gaussian spread ``noise_sd``)
    of its ``fastest_log_ratios``; capped at twice the threshold, so that a
    rank that recovers is cleared within a few iterations. A finding's
    confidence: how sure the ratios since the CUSUM last left 0 make it that
    the rank is at least ``slowdown`` slower (a host that slows a rank a
    little for long is named, with a low confidence a policy can ignore)."""

    slowdown: float = LIVE_SLOWDOWN
    threshold: float = LIVE_THRESHOLD
    noise_sd: float = LIVE_NOISE_SD
    cusum: dict[int, float] = field(default_factory=dict)
    latest: dict[int, float] = field(default_factory=dict)
    since: dict[int, tuple[float, int]] = field(default_factory=dict)  # (sum, count) since 0

    def update(self, ratios: dict[int, float]) -> None:
        shift = math.log(self.slowdown)
        for r, x in ratios.items():
            llr = shift * (x - shift / 2) / self.noise_sd ** 2
            self.cusum[r] = min(2 * self.threshold, max(0.0, self.cusum.get(r, 0.0) + llr))
            total, count = self.since.get(r, (0.0, 0))
            self.since[r] = (total + x, count + 1) if self.cusum[r] > 0 else (0.0, 0)
        self.latest.update(ratios)

    def confidence(self, rank: int) -> float:
        total, count = self.since.get(rank, (0.0, 0))
        if not count:
            return 0.0
        mean = total / count
        return NormalDist().cdf((mean - math.log(self.slowdown)) * math.sqrt(count)
                                / self.noise_sd)

    def slow(self) -> dict[int, RootCause]:
        """The ranks whose evidence stands at the threshold, as findings."""
        return {r: RootCause(r, "compute", None, self.confidence(r), {
            "cusum_llr": round(s, 3), "log_ratio_to_peers": round(self.latest[r], 4),
            "iterations_summed": self.since[r][1]})
            for r, s in sorted(self.cusum.items()) if s >= self.threshold}


class LiveScan(OnlineScan):
    """On-line MegaScan for real ranks: a rank with stage peers is named by
    its ``SlowdownTest`` (evidence summed across iterations, so a lasting
    slowdown is named as soon as it adds up and a rank stretched for an
    iteration or two is not); links and ranks without peers as ``OnlineScan``
    names them (``confirm`` windows in a row)."""

    def __init__(self, config: OnlineConfig, gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
                 scenario: Scenario | None = None, test: SlowdownTest | None = None):
        super().__init__(config, gpus_per_node=gpus_per_node, scenario=scenario)
        self.test = test if test is not None else SlowdownTest()
        self._judged: set[int] = set()  # ranks the test speaks for

    def feed(self, iteration: int, cols: EventColumns) -> list[Detection]:
        ratios = fastest_log_ratios(cols, stage_classes(cols))
        self.test.update(ratios)
        self._judged |= set(ratios)
        return super().feed(iteration, cols)

    def _findings(self) -> dict[SuspectKey, RootCause]:
        found = {k: c for k, c in super()._findings().items()
                 if not (k[0] == "compute" and k[1] in self._judged)}
        found.update((("compute", r, None), c) for r, c in self.test.slow().items()
                     if c.confidence >= self.config.min_confidence)
        return found

    def _confirmed(self, key: SuspectKey, hits: int) -> bool:
        """The test's findings are verdicts at once: they sum every iteration's evidence."""
        return (key[0] == "compute" and key[1] in self._judged) or super()._confirmed(key, hits)


def scan_for(s: Scenario, config: OnlineConfig | None = None, live: bool = False
             ) -> OnlineScan:
    """The on-line detector for a run of ``s`` (its node size, its model for the work of
    ranks without stage peers). ``live``: events as real ranks record them, each
    on its own clock, aligned in each window when the scenario skews a clock;
    ranks with stage peers judged by ``SlowdownTest``, other verdicts need
    ``LIVE_CONFIRM`` windows in a row unless ``config`` says."""
    if config is None:
        config = OnlineConfig(confirm=LIVE_CONFIRM) if live else OnlineConfig()
    if live:
        config = replace(config, aligned=not any(f.kind == "clock_skew" for f in s.faults))
        return LiveScan(config, gpus_per_node=s.cluster.gpus_per_node, scenario=s)
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
            self.report(self.scan.feed(iteration, columns_from_events(events)))
            self.fed.append(iteration)
