"""MegaScan's detector: blame in seconds over the job's dependency graph, fed
batch by batch, judged against the noise it measures.

In one paragraph: each batch of whole iterations is replayed over its
dependency graph (``graph``, ``replay``); every rank's compute, every rank's
host time and every link's transfers has an expected time (its peers', the
cost model's, or its own other iterations': ``expected``); a suspect's blame
by an iteration's end (its delay) is how much earlier that iteration would
end had it alone kept its recorded time while the others took their expected
one (``blame``). The noise is the spread of the same excess over the other
suspects of its kind and all iterations; a suspect is named for the
iterations in which it ran at least ``noise_multiple`` noise units over its
expected time and by whose end its delay was at least ``min_share`` of the
time the job had run, with a calibrated confidence (``params``). A link is
judged only where the trace gives the peer of every transfer at both its
ends: a transfer to an unknown rank could be the slow one, and its delay
lands on the next transfer its rank makes, which would be named in its
place (the ranks left so are reported). Where nothing can be
expected of a rank (a pipeline stage with no peers, no cost model, too few
iterations), the trace still shows the bottleneck: the rank that holds most
of the critical path, which is reported apart from root causes.

Incremental use (an on-line caller feeds each iteration as it ends)::

    detector = Detector(gpus_per_node=8, scenario=scenario)
    for batch in batches:          # ScanInput of whole iterations, aligned, linked
        detector.feed(batch)
        diagnosis = detector.verdict()   # at any time, on everything fed so far
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import comb
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from megatronapp.scenario.config import Scenario

from megatronapp.scan.align.inputs import (DEFAULT_GPUS_PER_NODE, ScanInput, load_table_scan,
                                           stored_batches, stored_events)
from megatronapp.scan.align.table import COLLECTIVE, P2P
from megatronapp.trace.columns import KINDS
from megatronapp.scan.diagnosis import Diagnosis, RootCause
from megatronapp.scan.ingest.sketch import Reservoirs
from megatronapp.scan.ingest.work import ModelledWork, job_of

from .blame import Finding, blame_batch, scale_of, sigma_of
from .replay import CriticalShare
from .params import Params

Key = tuple[str, Any]  # (kind, rank or (low, high) link)
QUARTILE_Z = 0.6745  # a normal sample's first quartile lies this many deviations below its median
# the smallest noise: traces are written in microseconds, and no finding is surer than its timer
TIMER_RESOLUTION_S = 1e-6
MANY_SUSPECTS = 64  # of a kind: leaving two out changes their spread by a few percent at most


FIELDS = ("iterations", "actual", "expected", "blame", "delay", "elapsed", "each_way")


@dataclass
class _Record:
    """A suspect's per-iteration figures, iteration by iteration: all of them
    while they number at most twice ``capacity``, then every other one (then
    every fourth...), as ``sketch.Reservoir`` thins a stream."""

    basis: str
    capacity: int
    iterations: list[int] = field(default_factory=list)
    actual: list[float] = field(default_factory=list)
    expected: list[float] = field(default_factory=list)
    blame: list[float] = field(default_factory=list)
    delay: list[float] = field(default_factory=list)
    elapsed: list[float] = field(default_factory=list)
    each_way: list[float] = field(default_factory=list)
    stride: int = 1
    seen: int = 0

    def add(self, f: Finding) -> None:
        for i, *values in zip(f.iterations.tolist(), f.actual.tolist(), f.expected.tolist(),
                              f.blame.tolist(), f.delay.tolist(), f.elapsed.tolist(),
                              f.each_way.tolist()):
            self.seen += 1
            if (self.seen - 1) % self.stride:
                continue
            self.iterations.append(int(i))
            for name, value in zip(FIELDS[1:], values):
                getattr(self, name).append(value)
            if len(self.iterations) > 2 * self.capacity:
                self.stride *= 2
                self.keep(list(range(0, len(self.iterations), 2)))

    def keep(self, positions: list[int]) -> None:
        for name in FIELDS:
            values = getattr(self, name)
            setattr(self, name, [values[k] for k in positions])


class Detector:
    """MegaScan fed batch by batch (see the module's docstring)."""

    def __init__(self, gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
                 scenario: Scenario | None = None, params: Params = Params(),
                 work: ModelledWork | None = None):
        """``work``: the scenario's modelled work, shared by detectors of one
        job (an on-line scan's windows) so that it is worked out once."""
        scenario = job_of(scenario)
        self.gpus_per_node, self.scenario, self.params = gpus_per_node, scenario, params
        self._modelled = work if work is not None else ModelledWork(scenario)
        self._records: dict[Key, _Record] = {}
        self._noise: Reservoirs[Key] = Reservoirs(params.capacity)
        self._partners: dict[Key, Key] = {}
        self._duration: dict[int, float] = {}
        self._bases: dict[str, dict[str, int]] = {}
        self._met: dict[tuple[int, ...], set[int]] = {}
        self._pairs: set[tuple[int, int]] = set()
        self._ranks: set[int] = set()
        self._unplaced: set[int] = set()  # ranks with a transfer whose peer the trace lacks
        self._held: dict[int, np.ndarray] = {}  # rank -> critical seconds: compute, host, comm
        self._critical_s = 0.0  # the iterations' seconds those shares are of

    def feed(self, batch: ScanInput) -> None:
        """Take in one batch of whole iterations, aligned and linked."""
        ranks = batch.ranks
        self._ranks.update(ranks)
        work = self._modelled(ranks) if self.scenario is not None else {}
        b = blame_batch(batch, work, self.params.shortlist)
        for i, d in zip(b.iterations.tolist(), b.duration.tolist()):
            self._duration[int(i)] = max(d, self._duration.get(int(i), 0.0))
        for f in b.findings:
            self._records.setdefault((f.kind, f.key),
                                     _Record(f.basis, self.params.capacity)).add(f)
        for kind, samples in b.noise.items():
            self._noise.add_all({(kind, key): v for key, v in samples.items()})
        for kind, partners in b.partners.items():
            self._partners.update({(kind, k): (kind, p) for k, p in partners.items()})
        for kind, counts in b.bases.items():
            into = self._bases.setdefault(kind, {})
            for basis, n in counts.items():
                into[basis] = into.get(basis, 0) + n
        if b.critical is not None:
            self._add_critical(b.critical, b.duration)
        met, pairs = op_members(batch)
        for group, members in met.items():
            self._met.setdefault(group, set()).update(members)
        self._pairs |= pairs
        self._unplaced |= unplaced_ranks(batch)

    def _add_critical(self, share: CriticalShare, duration: np.ndarray) -> None:
        parts = np.stack([share.compute.sum(axis=0), share.host.sum(axis=0),
                          share.communication.sum(axis=0)], axis=1)
        for rank, held in zip(share.ranks.tolist(), parts):
            self._held[rank] = self._held.get(rank, np.zeros(3)) + held
        self._critical_s += float(np.nansum(duration))

    def bottleneck(self) -> dict[str, Any]:
        """The rank that held most of the critical path, and its shares."""
        if not self._held or self._critical_s <= 0:
            return {}
        rank = max(self._held, key=lambda r: (self._held[r].sum(), -r))
        held = self._held[rank] / self._critical_s
        return {"rank": int(rank), "share": float(held.sum()), "compute_share": float(held[0]),
                "host_share": float(held[1]), "communication_share": float(held[2])}

    def verdict(self) -> Diagnosis:
        """The diagnosis of everything fed so far."""
        evidence = self.evidence()
        causes = merged(judge(evidence, self.params))
        return Diagnosis(tuple(causes), victims_of(causes, self._met, self._pairs),
                         unjudged=self._unjudged(), bottleneck=self.bottleneck(),
                         links_unjudged_at=tuple(sorted(self._unplaced)),
                         slow_without_cost=tuple(without_cost(evidence, causes, self.params)))

    def forget_before(self, iteration: int) -> None:
        """Drop every figure of the iterations before ``iteration`` (an on-line
        scan's window); the noise measured on them stays."""
        for key in list(self._records):
            rec = self._records[key]
            keep = [k for k, i in enumerate(rec.iterations) if i >= iteration]
            if not keep:
                del self._records[key]
                continue
            rec.keep(keep)
        self._duration = {i: d for i, d in self._duration.items() if i >= iteration}
        self._held, self._critical_s = {}, 0.0  # what the next batches' paths show

    def evidence(self) -> list[Evidence]:
        """Every shortlisted suspect's figures per iteration, with its noise in seconds."""
        noise = NoiseModel(self._noise, self._partners, self.params.min_noise_samples)
        out = []
        for (kind, who), rec in self._records.items():
            if kind == "link" and self._unplaced.intersection(who):
                continue  # a transfer at one of its ends went to a rank the trace does not say
            expected = np.asarray(rec.expected)
            sigma = noise.sigma((kind, who))
            out.append(Evidence(
                kind, who, rec.basis, np.asarray(rec.iterations), np.asarray(rec.actual),
                expected, np.asarray(rec.blame),
                np.maximum(scale_of(kind, sigma, expected), TIMER_RESOLUTION_S),
                np.array([self._duration.get(i, np.nan) for i in rec.iterations]),
                np.asarray(rec.delay), np.asarray(rec.elapsed), np.asarray(rec.each_way)))
        return out

    def state_entries(self) -> int:
        """Values held: each suspect's figures and noise samples, the iterations'
        lengths, group members and pairs (what the state's size is counted in)."""
        referenced = {i for rec in self._records.values() for i in rec.iterations}
        self._duration = {i: d for i, d in self._duration.items() if i in referenced}
        return (sum(len(FIELDS) * len(r.iterations) for r in self._records.values())
                + self._noise.entries() + len(self._duration) + len(self._held)
                + sum(len(m) for m in self._met.values()) + len(self._pairs))

    def _unjudged(self) -> dict[str, int]:
        """How many suspects of each kind had no expected time (nothing to judge them by)."""
        return {kind: counts.get("none", 0) for kind, counts in self._bases.items()
                if counts.get("none", 0)}


@dataclass(frozen=True)
class Evidence:
    """One suspect's figures per iteration it was shortlisted in (seconds)."""

    kind: str
    who: Any  # a rank, or a link's (low, high) ranks
    basis: str
    iterations: np.ndarray
    actual: np.ndarray
    expected: np.ndarray
    blame: np.ndarray
    noise: np.ndarray
    duration: np.ndarray
    delay: np.ndarray  # by each iteration's end, the delay it had caused in its batch
    elapsed: np.ndarray  # ... and how long that batch had run
    # links: per iteration, the least slowdown of the directions it carried
    # traffic in (``expected.Table.each_way``); NaN for ranks
    each_way: np.ndarray | None = None

    @property
    def units(self) -> np.ndarray:
        """How many noise units over its expected time it ran, per iteration."""
        return (self.actual - self.expected) / self.noise

    @property
    def slowdown(self) -> np.ndarray:
        """How far over its expected time it ran, relative to it, per iteration."""
        with np.errstate(all="ignore"):
            return np.where(self.expected > 0, (self.actual - self.expected) / self.expected,
                            np.inf)

    def over(self, p: Params) -> np.ndarray:
        """Iterations it ran ``noise_multiple`` noise units and ``min_slowdown``
        over its expected time in."""
        return (self.units >= p.noise_multiple) & (self.slowdown >= p.min_slowdown)

    def hits(self, p: Params) -> np.ndarray:
        """Iterations it was slow in (``noise_multiple`` noise units and
        ``min_slowdown`` over its expected time) by whose end it had delayed
        the job (at least ``min_share`` of the time the job had run: an
        iteration that makes up some of an earlier one's delay leaves the
        rest standing)."""
        return self.over(p) & delayed(self.delay, self.elapsed, p)


def delayed(delay: np.ndarray, elapsed: np.ndarray, p: Params) -> np.ndarray:
    """Whether a suspect had delayed the job by ``min_share`` of the time it had run."""
    return (delay > 0) & (delay >= p.min_share * elapsed)


def judge(evidence: Iterable[Evidence], p: Params) -> list[RootCause]:
    """The root causes: every suspect with an iteration whose blame holds
    ``noise_multiple`` noise units and ``min_share`` of the iteration."""
    return [c for e in evidence if (c := judged(e, p)) is not None]


RECURS = 2  # an intermittent fault is one seen in at least two iterations
# a healthy suspect is called persistent by chance at most this often (the conventional 1%)
SIGNIFICANCE = 0.01


def persistent(hit: np.ndarray, p: Params) -> bool:
    """Whether a suspect counts in every iteration it was seen in, or in so
    many of them that a healthy suspect, counting in each by chance with
    probability ``chance_count`` (the machine's noise alone carrying it over
    the bars), would count in as many with probability at most
    ``SIGNIFICANCE``. A longer trace lets a persistent fault miss a few
    iterations its noise hid it in: at ``chance_count`` 0.35, none of 4 or 6,
    three of 12."""
    n, k = len(hit), int(np.count_nonzero(hit))
    return k > 0 and (k == n or binomial_tail(k, n, p.chance_count) <= SIGNIFICANCE)


def binomial_tail(k: int, n: int, chance: float) -> float:
    """The probability of at least ``k`` successes in ``n`` trials of ``chance``."""
    return float(sum(comb(n, j) * chance ** j * (1.0 - chance) ** (n - j)
                     for j in range(k, n + 1)))


def named_iterations(units: np.ndarray, hit: np.ndarray, p: Params) -> np.ndarray:
    """The iterations a suspect is named for: those it counts in when it is
    persistent (``persistent``), else those with ``recur_multiple`` noise
    units, if at least ``RECURS`` (intermittent); none otherwise."""
    if persistent(hit, p):
        return hit
    strong = hit & (units >= p.recur_multiple)
    return strong if strong.sum() >= RECURS else np.zeros_like(hit)


def judged(e: Evidence, p: Params) -> RootCause | None:
    hit = named_iterations(e.units, e.hits(p), p)
    return finding(e, hit, p) if hit.any() else None


def without_cost(evidence: Iterable[Evidence], causes: Iterable[RootCause], p: Params
                 ) -> list[RootCause]:
    """Devices and links slow throughout that cost the job (almost) nothing:
    a rank's compute or a link's transfers over its expected time by
    ``noise_multiple`` noise units and ``min_slowdown`` in every iteration it
    was seen in (or as many as ``persistent`` asks), yet short of
    ``min_share`` of delay in some (a slow transfer the receiver did not
    wait for, a slow device with slack); a link, each way
    it carried traffic by ``min_slowdown`` (a degraded link is slow both ways;
    one whose receiver waits on a slow stage looks slow only the way it
    waits: its receives, posted first, measure whole transfers where its
    twins' measure what was left of them). Not root causes
    (the job is not slower for them, yet); listed so that degraded hardware is
    seen before it costs. Host time is left out: time outside ops that costs
    nothing is slack, not a fault. Those named as causes are left out too;
    the rest ranked by noise units."""
    named = {merge_key(c) for c in causes}
    out = [finding(e, over, p) for e in evidence
           if e.kind != "host" and persistent(over := e.over(p), p)
           and _each_way_slow(e, p) and merge_key(e) not in named]
    return sorted(merged(out), key=lambda c: (-float(c.evidence["noise_units"]), c.rank))


def _each_way_slow(e: Evidence, p: Params) -> bool:
    """A link slow by ``min_slowdown`` each way it carried traffic, in every
    iteration (a rank: always)."""
    return e.each_way is None or e.kind != "link" or bool(np.all(e.each_way >= p.min_slowdown))


def merge_key(c: RootCause | Evidence) -> tuple[object, ...]:
    """What ``merged`` keeps one of: a rank (its compute or host time), or a link."""
    if isinstance(c, Evidence):
        return ("link", *c.who) if c.kind == "link" else ("rank", c.who)
    return ("link", c.rank, c.peer) if c.kind == "link" else ("rank", c.rank)


def finding(e: Evidence, hit: np.ndarray, p: Params) -> RootCause:
    """``e`` as a cause found in the iterations ``hit``, with its evidence."""
    units = float(np.mean(e.units[hit]))
    rank, peer = (e.who if e.kind == "link" else (e.who, None))
    hits = e.iterations[hit]
    evidence = {
        "blame_s": float(np.mean(e.blame[hit])),
        "iteration_s": float(np.nanmean(e.duration[hit])),
        "share": float(np.nanmean(e.blame[hit] / e.duration[hit])),
        "actual_s": float(np.mean(e.actual[hit])),
        "expected_s": float(np.mean(e.expected[hit])),
        "expected_from": e.basis,
        "noise_s": float(np.mean(e.noise[hit])),
        "noise_units": units,
        "iterations_hit": hits.tolist() if len(hits) < len(e.iterations) else "all",
        "iterations_seen": len(e.iterations)}
    return RootCause(int(rank), e.kind, None if peer is None else int(peer),  # type: ignore[arg-type]
                     calibrated(units, p), evidence)


class NoiseModel:
    """The noise of each kind of suspect, in units of its expectation (or
    seconds, for host time), measured on the other suspects of its kind:
    the suspect judged, and any suspect whose expectation came from it alone
    (or it from them: a pair of peers mirror each other's excess), are left
    out, so that a faulty suspect's own swings never widen the bar it is
    judged against (with ``MANY_SUSPECTS`` or more, leaving two out cannot
    matter and the kind's figure is shared). Where suspects were seen in
    three or more iterations it has two parts: how much a suspect's excess
    moves from one iteration to the next (about its own median, pooled over
    the others), and how far healthy suspects sit apart from each other for
    good (the spread of their medians: the distance from the median suspect
    to the first quartile, in standard deviations; only the faster half is
    read, so that up to half the suspects may be slow without moving it).
    Where no other suspect is left (a pair of peers), the first part alone:
    the pair's gap is what is judged, so it cannot also be the bar (two
    iterations suffice to show how much each moves).
    Otherwise it is the spread of the others' excess."""

    def __init__(self, samples: Reservoirs[Key], partners: Mapping[Key, Key], fewest: int):
        self._samples, self._partners, self._fewest = samples, partners, fewest
        self._by_kind: dict[str, list[Key]] = {}
        for key in samples:
            self._by_kind.setdefault(key[0], []).append(key)
        self._pooled = {kind: sigma_of(np.concatenate([samples[k] for k in keys]))
                        for kind, keys in self._by_kind.items()}
        self._temporal = {kind: self._over_iterations(keys)
                          for kind, keys in self._by_kind.items()}

    def _seen(self, keys: list[Key], fewest: int = 3) -> list[np.ndarray]:
        return [v for k in keys if len(v := self._samples[k]) >= fewest]

    def _over_iterations(self, keys: list[Key]) -> float:
        seen = self._seen(keys)
        if not seen:
            return float("nan")
        medians = np.array([np.median(v) for v in seen])
        apart = (float(np.median(medians)) - float(np.percentile(medians, 25))) / QUARTILE_Z
        return float(np.hypot(self._moves(seen), apart))

    @staticmethod
    def _moves(seen: list[np.ndarray]) -> float:
        return sigma_of(np.concatenate([v - np.median(v) for v in seen]))

    def sigma(self, key: Key) -> float:
        keys = self._by_kind.get(key[0], [])
        many = len(keys) >= MANY_SUSPECTS  # a suspect and its peer cannot move a median of so many
        temporal = self._temporal.get(key[0], float("nan"))
        if np.isfinite(temporal) and len(self._samples.get(key, ())) >= 3:
            if many:
                return temporal
            others = self._over_iterations([k for k in keys if k not in self._left_out(key)])
            if np.isfinite(others):
                return others
            # a suspect and its one peer, no other: how far healthy suspects sit apart
            # cannot be read without a healthy one (the pair's own gap is the fault's),
            # only how much each moves from one iteration to the next
            return self._moves(self._seen(keys))
        if many:
            return self._pooled.get(key[0], float("nan"))
        left_out = self._left_out(key)
        kept = [self._samples[k] for k in keys if k not in left_out]
        if not kept:
            # a pair seen in two iterations: as above, how much each moves, which
            # two iterations show; the pair's own gap is never the bar
            moved = self._seen(keys, fewest=2)
            if sum(len(v) for v in moved) >= self._fewest:
                return self._moves(moved)
        if not kept or sum(len(v) for v in kept) < self._fewest:
            return self._pooled.get(key[0], float("nan"))
        return sigma_of(np.concatenate(kept))

    def _left_out(self, key: Key) -> set[Key | None]:
        """The suspect judged and those whose expectation came from it alone (or it from them)."""
        return {key, self._partners.get(key)} | {k for k, p in self._partners.items() if p == key}


def merged(causes: Iterable[RootCause]) -> list[RootCause]:
    """One cause per rank (its compute or its host time, whichever it is
    blamed more for; the other in its evidence as ``also``) and per link,
    most confident first, then most blamed."""
    best: dict[tuple[object, ...], list[RootCause]] = {}
    for c in causes:
        best.setdefault(merge_key(c), []).append(c)
    out = []
    for found in best.values():
        found.sort(key=lambda c: -float(c.evidence["blame_s"]))
        lead = found[0]
        if len(found) > 1:
            also = {"kind": found[1].kind, "blame_s": found[1].evidence["blame_s"]}
            lead = replace(lead, confidence=max(c.confidence for c in found),
                           evidence={**lead.evidence, "also": also})
        out.append(lead)
    return sorted(out, key=lambda c: (-c.confidence, -float(c.evidence["blame_s"]), c.rank))


def calibrated(units: float, p: Params) -> float:
    """The confidence of a finding whose blame holds ``units`` noise units."""
    x = p.confidence_slope * (np.log(max(units, 1e-12)) - np.log(max(p.noise_multiple, 1e-12)))
    return float(1.0 / (1.0 + np.exp(-(x + p.confidence_offset))))


# ------------------------------------------------------------- victims
def unplaced_ranks(scan: ScanInput) -> set[int]:
    """Ranks with a point-to-point transfer whose peer the trace does not give
    (not recorded, nor inferred for sure: ``ingest.p2p_infer``)."""
    cols = scan.cols
    lost = (cols.kind == KINDS.index("p2p")) & (cols.peer < 0)
    return set(np.unique(cols.rank[lost]).tolist())


def op_members(scan: ScanInput) -> tuple[dict[tuple[int, ...], set[int]], set[tuple[int, int]]]:
    """The ranks that met in a sync op: per collective group (its ranks, sorted)
    those that joined its calls, and each pair that exchanged a transfer."""
    sync, cols = scan.sync, scan.cols
    rank = cols.rank[sync.member_row].astype(np.int64)
    coll = sync.op_kind[sync.member_op] == COLLECTIVE
    group = cols.group[sync.member_row[sync.op_start[sync.member_op]]].astype(np.int64)
    met: dict[tuple[int, ...], set[int]] = {}
    width = int(rank.max(initial=0)) + 1
    for key in np.unique(group[coll] * width + rank[coll]).tolist():
        g, r = divmod(key, width)
        if g >= 0:
            met.setdefault(tuple(sorted(cols.groups[g])), set()).add(r)
    p2p = np.flatnonzero(sync.op_kind == P2P)
    a = cols.rank[sync.sender[p2p]].astype(np.int64)
    b = cols.rank[sync.receiver[p2p]].astype(np.int64)
    return met, {(min(x, y), max(x, y)) for x, y in zip(a.tolist(), b.tolist()) if x != y}


def victims_of(causes: Iterable[RootCause], met: Mapping[tuple[int, ...], set[int]],
               pairs: Iterable[tuple[int, int]]) -> tuple[int, ...]:
    """Ranks that share a sync op with a rank named for its compute or host
    time (they waited for it)."""
    causes = list(causes)
    sources = {c.rank for c in causes if c.kind != "link"}
    waited: set[int] = set()
    for members in met.values():
        if members & sources:
            waited |= members
    for pair in pairs:
        if sources.intersection(pair):
            waited.update(pair)
    named = {c.rank for c in causes} | {c.peer for c in causes if c.peer is not None}
    return tuple(sorted(waited - named))


# ------------------------------------------------------------ entry points
def megascan(scan: ScanInput, params: Params = Params(),
             work: ModelledWork | None = None) -> Diagnosis:
    """MegaScan on one trace: a detector fed it as one batch (``work``: the
    modelled work of ``scan.scenario``, when already at hand)."""
    detector = Detector(scan.gpus_per_node, scan.scenario, params, work=work)
    detector.feed(scan)
    return detector.verdict()


def megascan_stored(store: Path, scenario: Scenario | None = None,
                    params: Params = Params()) -> Diagnosis:
    """MegaScan on a stored run, fed batch by batch (``inputs.stored_batches``);
    the run's own scenario unless ``scenario`` is given. Events that carry no
    iteration (a foreign store) are in no batch: such a run is fed whole."""
    detector: Detector | None = None
    fed = 0
    for batch in stored_batches(store):
        detector = detector or Detector(batch.gpus_per_node, scenario or batch.scenario, params)
        detector.feed(batch)
        fed += batch.job_events
    if detector is None or fed != stored_events(store):
        whole = load_table_scan(store)
        return megascan(replace(whole, scenario=scenario or whole.scenario), params)
    return detector.verdict()
