"""MegaScan's root-cause detector: the paper's multi-stage heuristic, measured,
over event columns (every input: ``inputs.ScanInput``), batch by batch.

1. Compare every compute op with the same op on the ranks doing identical work
   (same pp stage: its TP and DP peers). A rank whose ops are consistently
   slower than its peers' (median log-ratio, judged against the run's own
   noise) is a candidate.
2. Within TP/DP collectives the true source *starts* late (it arrives last);
   its peers wait and only look slow. A candidate that is rarely the last to
   arrive is a victim of something else and is dropped.
3. Point-to-point effective bandwidth (bytes / transfer time) per rank pair,
   against pairs of the same link class: a slow or erratic link.

Incremental use (an on-line caller feeds each iteration as it ends)::

    detector = Detector(gpus_per_node=8, scenario=scenario)
    for batch in batches:          # ScanInput of whole sync ops: an iteration, several
        detector.feed(batch)       # aligned, linked (inputs.prepare_columns)
        diagnosis = detector.verdict()   # at any time, on everything fed so far

A batch must hold whole sync ops (every member of each collective and both
sides of each transfer), e.g. every rank's events of one or more iterations;
its compute is compared among the stage peers that its TP/DP collectives and
those of the batches before it tie together.
What the detector keeps is per rank (log ratios to its peers, late-arrival
counts), per rank and op name (durations), per rank pair (seconds per byte),
per channel (delivery waits) and per group (members), each sample a bounded
``sketch.Reservoir``: its size depends on ranks, channels and op names, not
on how many events were fed (``Detector.state_entries``). ``megascan`` is one
batch. ``judge`` holds the statistics and thresholds that name the causes.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np

from megatronapp.scenario.config import Scenario
from megatronapp.trace.columns import EventColumns
from megatronapp.trace.metrics import group_ids

from megatronapp.scan.align.components import classes_of
from megatronapp.scan.diagnosis import Diagnosis, RootCause, ranked
from megatronapp.scan.evidence.held import middle_stages, with_held
from megatronapp.scan.align.inputs import (DEFAULT_GPUS_PER_NODE, ScanInput, load_table_scan, stored_batches,
                     stored_events)
from megatronapp.scan.evidence.iteration_totals import IterationTotals
from megatronapp.scan.evidence.judge import (MAD_TO_SIGMA, Channel, ComputeScore, PairStats, Thresholds,
                    durations_per_work, finite_rows, flow_of, judge_bandwidth, judge_compute,
                    judge_links, lonely_work, relative_to_peers, row_scores)
from megatronapp.scan.ingest.sketch import DEFAULT_CAPACITY, Reservoirs
from megatronapp.scan.ingest.twins import Twins
from megatronapp.scan.align.table import COLLECTIVE, COMPUTE_KIND, P2P
from megatronapp.scan.evidence.waits import (COLLECTIVE_KIND, P2P_KIND, RECEIVE, PerIteration, WaitAccumulator, WaitScores,
                    with_waits)
from megatronapp.scan.ingest.work import ModelledWork, Work

STAGE_PEER_WORDS = ("tp", "dp", "tensor", "data")  # collectives among ranks doing identical work
LATE_WORDS = STAGE_PEER_WORDS


def _first_word_in(names: tuple[str, ...], words: tuple[str, ...]) -> np.ndarray:
    return np.array([n.lower().split("_")[0] in words for n in names] + [False])


# ------------------------------------------------------------ stage peers
def peer_edges(scan: ScanInput) -> tuple[np.ndarray, np.ndarray]:
    """Rank pairs a TP/DP collective joins (consecutive members of each op,
    each pair once): ranks so joined run the same compute."""
    sync, cols = scan.sync, scan.cols
    word = _first_word_in(cols.names, STAGE_PEER_WORDS)
    ops = (sync.op_kind == COLLECTIVE) & word[sync.op_name.astype(np.int64)]
    keep = ops[sync.member_op]
    op, rank = sync.member_op[keep], cols.rank[sync.member_row[keep]].astype(np.int64)
    same = op[1:] == op[:-1]  # consecutive members of one op: one edge each
    edges = _unique_pairs(rank[:-1][same], rank[1:][same])
    return edges[:, 0], edges[:, 1]


def stage_peers(scan: ScanInput) -> dict[int, tuple[int, ...]]:
    """rank -> ranks that run the same compute (joined by its TP and DP collectives)."""
    return classes_of(np.unique(scan.cols.rank), *peer_edges(scan))


# --------------------------------------------------------------- stage 1
def _compute_keys(scan: ScanInput) -> tuple[np.ndarray, np.ndarray]:
    """Compute rows with a duration, and their op key id (name, iteration,
    microbatch, chunk, occurrence on the rank)."""
    c = scan.cols
    rows = np.flatnonzero((c.kind == COMPUTE_KIND) & (c.dur_s > 0))
    base, _ = group_ids(c.rank[rows], c.name[rows], c.iteration[rows], c.microbatch[rows],
                        c.chunk[rows])
    occurrence = np.zeros(len(rows), np.int64)
    if len(rows):
        order = np.argsort(base, kind="stable")
        b = base[order]
        starts = np.r_[0, np.flatnonzero(b[1:] != b[:-1]) + 1]
        occurrence[order] = np.arange(len(b)) - np.repeat(starts, np.diff(np.r_[starts, len(b)]))
    key, _ = group_ids(c.name[rows], c.iteration[rows], c.microbatch[rows], c.chunk[rows],
                       occurrence)
    return rows, key


def _log_ratios(ranks: list[int], rank_of_row: np.ndarray, key: np.ndarray,
                logdur: np.ndarray, weight: np.ndarray | None = None) -> np.ndarray:
    """Rows = ranks, columns = keys on 2+ of them (``weight``: per rank of the
    job, the ranks it stands for; default each itself)."""
    sorted_ranks = np.array(ranks, np.int64)
    position = np.argsort(sorted_ranks)
    mine = np.isin(rank_of_row, sorted_ranks)
    r_idx = position[np.searchsorted(sorted_ranks[position], rank_of_row[mine])]
    k = key[mine]
    times = None if weight is None else weight[sorted_ranks]
    counts = (np.bincount(k, None if times is None else times[r_idx]).astype(np.int64)
              if len(k) else np.zeros(0, np.int64))
    shared = np.flatnonzero(counts >= 2)
    col_of = np.full(len(counts), -1, np.int64)
    col_of[shared] = np.arange(len(shared))
    logd = np.full((len(ranks), len(shared)), np.nan)
    ok = col_of[k] >= 0
    logd[r_idx[ok], col_of[k][ok]] = logdur[mine][ok]
    return relative_to_peers(logd, times)


NO_RATIOS = np.zeros(0)  # a rank that ran none of the ops its peers ran
LogRatios = dict[int, np.ndarray]  # rank -> its log ratios to its stage peers
CrossRatios = dict[tuple[int, str], np.ndarray]  # (rank, op name) -> ratios across stages


def log_ratio_rows(scan: ScanInput, peers: Mapping[int, tuple[int, ...]], work: Work
                   ) -> tuple[LogRatios, CrossRatios]:
    """Each rank's log ratios of its compute ops to the same ops on its stage
    ``peers``; ranks without stage peers are compared across stages op name by
    op name, each op's duration per unit of the ``work`` it models. A batch
    read by replicas counts each present rank once per twin."""
    weight = scan.twins.weight if scan.twins is not None else None
    rows, key = _compute_keys(scan)
    rank_of_row = scan.cols.rank[rows].astype(np.int64)
    logdur = np.log(scan.cols.dur_s[rows]) - _log_work(scan, rows, work)
    classes = sorted({p for p in peers.values() if len(p) > 1})
    lonely = sorted(r for r, p in peers.items() if len(p) == 1)
    class_of = {r: i for i, cls in enumerate(classes) for r in cls}
    row_class = np.array([class_of.get(r, -1) for r in range(int(rank_of_row.max()) + 1)]
                         if len(rank_of_row) else [], np.int64)[rank_of_row]
    order = np.argsort(row_class, kind="stable")
    cuts = np.searchsorted(row_class[order], np.arange(len(classes) + 1))
    ratios: LogRatios = {}
    for i, cls in enumerate(classes):
        mine = order[cuts[i]:cuts[i + 1]]
        lr = _log_ratios(list(cls), rank_of_row[mine], key[mine], logdur[mine], weight)
        ratios.update(zip(cls, finite_rows(lr)))
    cross: CrossRatios = {}
    if len(lonely) >= 2:
        name = scan.cols.name[rows]
        for code in np.unique(name).tolist():
            mine = name == code
            lr = _log_ratios(lonely, rank_of_row[mine], key[mine], logdur[mine])
            cross.update(((r, scan.cols.names[code]), v) for r, v in zip(lonely, finite_rows(lr)))
    return ratios, cross


def compute_scores(ratios: Reservoirs[int], cross: Reservoirs[tuple[int, str]],
                   peers: Mapping[int, tuple[int, ...]], th: Thresholds) -> dict[int, ComputeScore]:
    """Stage 1 for every rank, from its log ratios (``log_ratio_rows``) as
    sampled; the ops each score reports are those compared, sampled or not."""
    scores: dict[int, ComputeScore] = {}
    for cls in sorted({p for p in peers.values() if len(p) > 1}):
        for r, (med, z, share, _) in row_scores(cls, [ratios.get(r, NO_RATIOS) for r in cls],
                                                th).items():
            scores[r] = ComputeScore(r, med, z, share, ratios.seen(r), cls)
    lonely = tuple(sorted(r for r, p in peers.items() if len(p) == 1))
    if len(lonely) >= 2:
        scores.update(_cross_stage(lonely, cross, th))
    return scores


def _cross_stage(ranks: tuple[int, ...], cross: Reservoirs[tuple[int, str]],
                 th: Thresholds) -> dict[int, ComputeScore]:
    """Pipeline stages differ (the last one computes the logits): judge each op
    name apart and keep a rank's middle name (the lower one of two), so only a
    rank slow at most of what it does stands out, not one stage's extra work."""
    per_rank: dict[int, list[ComputeScore]] = {}
    for name in sorted({n for _, n in cross}):
        rows = [cross.get((r, name), NO_RATIOS) for r in ranks]
        for r, (med, z, share, n) in row_scores(ranks, rows, th).items():
            if n >= 2:
                per_rank.setdefault(r, []).append(
                    ComputeScore(r, med, z, share, cross.seen((r, name)), ranks))
    return {r: sorted(s, key=lambda c: c.z)[(len(s) - 1) // 2] for r, s in per_rank.items()}


def end_stages(waited: WaitScores, peers: Mapping[int, tuple[int, ...]]) -> set[int]:
    """A pipeline's first and last stages (alone in their stage, receiving
    from one side only): without a model of each stage's work they are not
    judged on their compute, which holds work the middle stages do not
    (the embedding, the output layer and the loss), as ``held`` judges
    middle stages only."""
    middle = set(middle_stages(waited, peers))
    return {r for r, s in waited.receiving.items()
            if s > 0 and len(peers.get(r, (r,))) == 1 and r not in middle}


# --------------------------------------------------------------- stage 2
def late_arrivals(scan: ScanInput) -> dict[int, tuple[int, int]]:
    """rank -> (times it started a TP/DP collective last, collectives joined)."""
    sync, cols = scan.sync, scan.cols
    sizes = np.diff(np.r_[sync.op_start, len(sync.member_row)])
    word = _first_word_in(cols.names, LATE_WORDS)
    ops = (sync.op_kind == COLLECTIVE) & (sizes >= 2) & word[sync.op_name.astype(np.int64)]
    keep = ops[sync.member_op]
    op, row = sync.member_op[keep], sync.member_row[keep]
    if not len(op):
        return {}
    rank = cols.rank[row].astype(np.int64)
    joined = np.bincount(rank)
    lasts = np.bincount(_last_to_start(op, cols.start_s[row], rank), minlength=len(joined))
    return {int(r): (int(lasts[r]), int(joined[r])) for r in np.flatnonzero(joined)}


def _last_to_start(op: np.ndarray, start: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Per op, the rank that started it last (a tie: the highest rank). Rows come
    grouped by op (a sync table's memberships), so no sort of millions of rows."""
    if not bool((op[1:] >= op[:-1]).all()):
        order = np.lexsort((rank, start, op))
        op, start, rank = op[order], start[order], rank[order]
    cuts = np.r_[0, np.flatnonzero(op[1:] != op[:-1]) + 1]
    latest = np.repeat(np.maximum.reduceat(start, cuts), np.diff(np.r_[cuts, len(op)]))
    return np.maximum.reduceat(np.where(start == latest, rank, -1), cuts)


def durations_of(scan: ScanInput) -> dict[int, dict[str, np.ndarray]]:
    """rank -> op name -> its compute durations."""
    c = scan.cols
    rows = np.flatnonzero((c.kind == COMPUTE_KIND) & (c.dur_s > 0))
    out: dict[int, dict[str, np.ndarray]] = {}
    for idx in _groups_of(c.rank[rows], c.name[rows]):
        first = rows[idx[0]]
        out.setdefault(int(c.rank[first]), {})[c.names[int(c.name[first])]] = c.dur_s[rows[idx]]
    return out


def _log_work(scan: ScanInput, rows: np.ndarray, work: Work) -> np.ndarray:
    """log of the work each row's op models (0 where unknown)."""
    out = np.zeros(len(rows))
    c = scan.cols
    for rank, by_name in work.items():
        for name, w in by_name.items():
            code = c.name_code(name)
            out[(c.rank[rows] == rank) & (c.name[rows] == code)] = np.log(w)
    return out


# --------------------------------------------------------------- stage 3
def transfer_samples(scan: ScanInput) -> dict[tuple[int, int], np.ndarray]:
    """Unordered rank pair -> log(seconds per byte) of each of its transfers
    (the shorter of the send and the receive)."""
    sync, cols = scan.sync, scan.cols
    p2p = np.flatnonzero((sync.op_kind == P2P) & (sync.op_bytes > 0))
    send, recv = sync.sender[p2p], sync.receiver[p2p]
    seconds = np.where(cols.dur_s[recv] > 0, np.minimum(cols.dur_s[send], cols.dur_s[recv]),
                       cols.dur_s[send])
    ok = seconds > 0
    a, b = cols.rank[send][ok].astype(np.int64), cols.rank[recv][ok].astype(np.int64)
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    value = np.log(seconds[ok] / sync.op_bytes[p2p][ok])
    return {(int(lo[idx[0]]), int(hi[idx[0]])): value[idx] for idx in _groups_of(lo, hi)}


def _groups_of(*keys: np.ndarray) -> list[np.ndarray]:
    """Row indices of each distinct tuple of ``keys``, tuples in sorted order."""
    group, _ = group_ids(*keys)
    order = np.argsort(group, kind="stable")
    cuts = np.flatnonzero(np.diff(group[order])) + 1
    return np.split(order, cuts) if len(order) else []


def pair_stats(samples: Mapping[tuple[int, int], np.ndarray], th: Thresholds) -> list[PairStats]:
    """Per rank pair with ``min_transfers`` or more, the median and spread of its samples."""
    out = []
    known: dict[int, tuple[float, float]] = {}  # twin pairs share their samples' array
    for pair in sorted(samples):
        v = samples[pair]
        if len(v) < th.min_transfers:
            continue
        if id(v) not in known:
            med = float(np.median(v))
            known[id(v)] = (med, MAD_TO_SIGMA * float(np.median(np.abs(v - med))))
        out.append(PairStats(pair, *known[id(v)], len(v)))
    return out


def delivery_waits(scan: ScanInput) -> dict[Channel, np.ndarray]:
    """(pair, direction) -> how long each receive went on after both sides
    were ready (after its send started, or after it was posted if later).
    The direction (forward, backward, or which way when unnamed) keeps a
    pipeline's two flows apart: they wait for different things."""
    sync, cols = scan.sync, scan.cols
    p2p = np.flatnonzero(sync.op_kind == P2P)
    send, recv = sync.sender[p2p], sync.receiver[p2p]
    end = cols.start_s[recv] + cols.dur_s[recv]
    wait = np.maximum(end - np.maximum(cols.start_s[send], cols.start_s[recv]), 0.0)
    s, r = cols.rank[send].astype(np.int64), cols.rank[recv].astype(np.int64)
    flows = np.array([flow_of(n) for n in cols.names] + [""], dtype=object)
    named = flows[cols.name[send].astype(np.int64)]
    direction = np.where(named != "", named, np.where(s < r, "up", "down"))
    lo, hi = np.minimum(s, r), np.maximum(s, r)
    codes, which = np.unique(direction.astype(str), return_inverse=True)
    return {((int(lo[idx[0]]), int(hi[idx[0]])), str(codes[which[idx[0]]])): wait[idx]
            for idx in _groups_of(lo, hi, which)}


# ------------------------------------------------------------- victims
def op_members(scan: ScanInput) -> tuple[dict[tuple[int, ...], set[int]], set[tuple[int, int]]]:
    """The ranks that met in a sync op: per collective group (its ranks, sorted)
    those that joined its calls, and each pair that exchanged a transfer."""
    sync, cols = scan.sync, scan.cols
    rank = cols.rank[sync.member_row].astype(np.int64)
    coll = sync.op_kind[sync.member_op] == COLLECTIVE
    group = cols.group[sync.member_row[sync.op_start[sync.member_op]]].astype(np.int64)
    met: dict[tuple[int, ...], set[int]] = {}
    joined = _unique_pairs(group[coll], rank[coll])  # (group id, rank), by group id
    for chunk in np.split(joined, np.flatnonzero(np.diff(joined[:, 0])) + 1):
        if len(chunk):
            met.setdefault(tuple(sorted(cols.groups[chunk[0, 0]])), set()).update(
                chunk[:, 1].tolist())
    p2p = np.flatnonzero(sync.op_kind == P2P)
    a = cols.rank[sync.sender[p2p]].astype(np.int64)
    b = cols.rank[sync.receiver[p2p]].astype(np.int64)
    pairs = _unique_pairs(np.minimum(a, b), np.maximum(a, b))
    return met, {(x, y) for x, y in pairs.tolist()}


def _unique_pairs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The distinct (a, b) rows, sorted (non-negative integers, one sort of one key)."""
    width = int(b.max()) + 1 if len(b) else 1
    key = np.unique(a.astype(np.int64) * width + b.astype(np.int64))
    return np.stack([key // width, key % width], axis=1)


def victims_of(causes: Iterable[RootCause], met: Mapping[tuple[int, ...], set[int]],
               pairs: Iterable[tuple[int, int]]) -> tuple[int, ...]:
    """Ranks that share a sync op with a compute root cause (they waited for it)."""
    causes = list(causes)
    sources = {c.rank for c in causes if c.kind == "compute"}
    waited: set[int] = set()
    for members in met.values():
        if members & sources:
            waited |= members
    for pair in pairs:
        if sources.intersection(pair):
            waited.update(pair)
    named = {c.rank for c in causes} | {c.peer for c in causes}
    return tuple(sorted(waited - named))


def diagnosis_of(causes: list[RootCause], victims: tuple[int, ...]) -> Diagnosis:
    """The verdict: every root cause, most confident first, and the victims."""
    return Diagnosis(ranked(causes), victims)


# ------------------------------------------------------------- detector
class Detector:
    """MegaScan fed batch by batch (see the module's docstring); the state is
    bounded samples per rank, op name, pair and channel (``capacity`` values each)."""

    def __init__(self, gpus_per_node: int = DEFAULT_GPUS_PER_NODE, scenario: Scenario | None = None,
                 th: Thresholds = Thresholds(), capacity: int = DEFAULT_CAPACITY,
                 work: ModelledWork | None = None):
        """``work``: the scenario's modelled work, shared by detectors of one
        job (an on-line scan's windows) so that it is worked out once."""
        self.gpus_per_node, self.scenario, self.th = gpus_per_node, scenario, th
        self._modelled = work if work is not None else ModelledWork(scenario)
        self._ranks: set[int] = set()
        self._edges: set[tuple[int, int]] = set()  # stage-peer ties
        self._ratios: Reservoirs[int] = Reservoirs(capacity)  # log ratios to stage peers
        self._cross: Reservoirs[tuple[int, str]] = Reservoirs(capacity)  # across stages
        self._durations: Reservoirs[tuple[int, str]] = Reservoirs(capacity)  # per work
        self._per_iteration = IterationTotals(capacity)  # each op's total per iteration
        self._late: dict[int, list[int]] = {}  # rank -> [last to start, collectives joined]
        self._transfers: Reservoirs[tuple[int, int]] = Reservoirs(capacity)  # log(s per byte)
        self._waits: Reservoirs[Channel] = Reservoirs(capacity)  # delivery waits
        self._met: dict[tuple[int, ...], set[int]] = {}  # group -> ranks that met in it
        self._pairs: set[tuple[int, int]] = set()
        self._work: dict[tuple[int, ...], Work] = {}
        self._peers: dict[int, tuple[int, ...]] = {}  # by the ties below, once counted
        self._peers_of = (0, 0)  # (ranks, ties) the stage peers were found from
        self._waited = WaitAccumulator()  # who waited for whom (``waits``)
        self._ops_fed = 0
        self._twins: Twins | None = None  # batches read by replicas: the state is theirs
        self._late_across: dict[int, list[int]] = {}  # ... and every rank's at their DP ops

    def feed(self, batch: ScanInput) -> None:
        """Take in one batch of whole sync ops, aligned and linked (a batch
        read by replicas: the present replicas' state, and every rank's at
        the collectives that join replicas)."""
        self._twins = self._twins or batch.twins
        if batch.across is not None:
            self._feed_across(batch.across)
        ranks = np.unique(batch.cols.rank).tolist()
        self._ranks.update(ranks)
        a, b = peer_edges(batch)
        self._edges.update(zip(a.tolist(), b.tolist()))
        peers = self._stage_peers(ranks)
        work = self._work_of(peers)
        ratios, cross = log_ratio_rows(batch, peers, work)
        self._ratios.add_all(ratios)
        self._cross.add_all(cross)
        for r, by_name in durations_of(batch).items():
            scaled = durations_per_work(by_name, work.get(r))
            self._durations.add_all({(r, n): np.asarray(v) for n, v in scaled.items()})
        self._per_iteration.feed(batch.cols)
        _count_late(self._late, batch)
        self._transfers.add_all(transfer_samples(batch))
        self._waits.add_all(delivery_waits(batch))
        self._feed_members(batch)
        self._waited.feed_receives(batch.cols)

    def _feed_across(self, across: ScanInput) -> None:
        """Every rank's collectives that join replicas: their ties, last
        arrivals, members and waits."""
        a, b = peer_edges(across)
        self._edges.update(zip(a.tolist(), b.tolist()))
        _count_late(self._late_across, across)
        self._feed_members(across)

    def _feed_members(self, batch: ScanInput) -> None:
        met, pairs = op_members(batch)
        for group, members in met.items():
            self._met.setdefault(group, set()).update(members)
        self._pairs |= pairs
        self._waited.feed(*wait_members(batch, self._ops_fed))
        self._ops_fed += batch.sync.ops

    def _stage_peers(self, ranks: Iterable[int]) -> dict[int, tuple[int, ...]]:
        """``ranks`` -> their stage peers among ``ranks``, by every tie fed so far
        (a microbatch's batch holds TP collectives, not the DP all-reduces)."""
        if self._peers_of != (len(self._ranks), len(self._edges)):
            edges = np.array(sorted(self._edges), np.int64).reshape(-1, 2)
            self._peers = classes_of(sorted(self._ranks), edges[:, 0], edges[:, 1])
            self._peers_of = (len(self._ranks), len(self._edges))
        mine = set(ranks)
        out: dict[int, tuple[int, ...]] = {}
        for cls in {id(self._peers[r]): self._peers[r] for r in mine}.values():  # shared tuples
            kept = tuple(p for p in cls if p in mine)
            out.update((p, kept) for p in kept)
        return out

    def _work_of(self, peers: Mapping[int, tuple[int, ...]]) -> Work:
        lonely = tuple(sorted(r for r, p in peers.items() if len(p) == 1))
        if lonely not in self._work:
            self._work[lonely] = lonely_work(self._modelled, peers)
        return self._work[lonely]

    def verdict(self) -> Diagnosis:
        """The diagnosis of everything fed so far."""
        if self._twins is not None:
            return self._every_twin(self._twins).verdict()
        ranks = sorted(self._ranks)
        peers = self._stage_peers(ranks)
        durations: dict[int, dict[str, np.ndarray]] = {}
        for (r, name), values in self._durations.items():
            durations.setdefault(r, {})[name] = values
        scores = compute_scores(self._ratios, self._cross, peers, self.th)
        late = {r: (last, joined) for r, (last, joined) in self._late.items()}
        waited = self._waited.scores()
        modelled = bool(self._work_of(peers))  # each stage's work priced by the scenario
        unjudged = set() if modelled else end_stages(waited, peers)
        compute = judge_compute([r for r in ranks if r not in unjudged], scores, late,
                                durations, peers, self.th)
        node = self.gpus_per_node
        links = judge_links(judge_bandwidth(pair_stats(self._transfers, self.th), node, self.th),
                            self._waits, node, self.th)
        causes = with_held(with_waits(compute + links, waited, durations,
                                      per_iteration=PerIteration(self._per_iteration.totals(),
                                                                 peers)),
                           waited, durations,
                           peers, node, name_stages=not modelled)
        return diagnosis_of(causes, victims_of(causes, self._met, self._pairs))

    def _every_twin(self, twins: Twins) -> "Detector":
        """A detector holding, for every rank of the job, what its present
        twin's batches gave (shared, not copied), its own last arrivals at
        the ops that join replicas, and stage peers of every rank."""
        def keyed(key: int) -> tuple[int, ...]:
            return twins.twins_of(key)

        def paired(pair: tuple[int, int]) -> list[tuple[int, int]]:
            return [(pair[0] + off, pair[1] + off) for off in twins.offsets(pair[0])]

        def named(key: tuple[int, str]) -> list[tuple[int, str]]:
            return [(t, key[1]) for t in twins.twins_of(key[0])]

        def channel(key: Channel) -> list[Channel]:
            return [(p, key[1]) for p in paired(key[0])]

        out = Detector(self.gpus_per_node, self.scenario, self.th, work=self._modelled)
        out._ranks = {t for r in self._ranks for t in twins.twins_of(r)}
        out._peers = {}
        for cls in {id(c): c for c in self._stage_peers(sorted(self._ranks)).values()}.values():
            every = tuple(sorted(t for r in cls for t in twins.twins_of(r)))
            out._peers.update((t, every) for t in every)
        out._peers_of = (len(out._ranks), len(out._edges))
        out._work = self._work
        out._ratios, out._cross = self._ratios.aliased(keyed), self._cross.aliased(named)
        out._durations = self._durations.aliased(named)
        out._per_iteration = self._per_iteration.aliased(named)
        out._transfers, out._waits = self._transfers.aliased(paired), self._waits.aliased(channel)
        for r, (last, joined) in self._late.items():
            out._late.update((t, [last, joined]) for t in twins.twins_of(r))
        for t, (last, joined) in self._late_across.items():
            counts = out._late.setdefault(t, [0, 0])
            counts[0] += last
            counts[1] += joined
        inside = _inside(twins)
        for group, members in self._met.items():
            for off in twins.offsets(group[0]) if inside(group) else (0,):
                out._met[tuple(r + off for r in group)] = {r + off for r in members}
        out._pairs = {p for pair in self._pairs for p in paired(pair)}
        out._waited = self._waited.mirrored(twins.offsets, inside)
        return out

    def state_entries(self) -> int:
        """Keys and values held: ranks, ties, samples, counts, group members, pairs."""
        samples = (self._ratios, self._cross, self._durations, self._transfers, self._waits)
        return (len(self._ranks) + len(self._edges) + sum(len(s) + s.entries() for s in samples)
                + self._per_iteration.entries() + 2 * len(self._late)
                + sum(len(m) for m in self._met.values()) + len(self._pairs))


def _count_late(into: dict[int, list[int]], scan: ScanInput) -> None:
    for r, (last, joined) in late_arrivals(scan).items():
        counts = into.setdefault(r, [0, 0])
        counts[0] += last
        counts[1] += joined


def _inside(twins: Twins) -> Callable[[tuple[int, ...]], bool]:
    """Whether a group stays inside one replica (remembered per group)."""
    known: dict[tuple[int, ...], bool] = {}

    def inside(group: tuple[int, ...]) -> bool:
        if group not in known:
            known[group] = not twins.spans_replicas(group)
        return known[group]
    return inside


def wait_members(scan: ScanInput, first_op: int = 0) -> tuple[EventColumns, np.ndarray]:
    """The sync table's member rows, each marked collective or p2p (a p2p
    member's role: receive or send), and its op numbered from ``first_op`` (so
    that ops of different batches never share a number)."""
    sync = scan.sync
    p2p = sync.op_kind[sync.member_op] == P2P
    receiving = sync.member_row == sync.receiver[sync.member_op]
    members = replace(scan.cols.take(sync.member_row),
                      kind=np.where(p2p, P2P_KIND, COLLECTIVE_KIND).astype(np.int8),
                      role=np.where(p2p, np.where(receiving, RECEIVE, 1 - RECEIVE), -1
                                    ).astype(np.int8))
    return members, sync.member_op.astype(np.int64) + first_op


def megascan(scan: ScanInput, th: Thresholds = Thresholds(),
             work: ModelledWork | None = None) -> Diagnosis:
    """MegaScan on one trace: a detector fed it as one batch (``work``: the
    modelled work of ``scan.scenario``, when already at hand)."""
    detector = Detector(scan.gpus_per_node, scan.scenario, th, work=work)
    detector.feed(scan)
    return detector.verdict()


def megascan_stored(store: Path, scenario: Scenario | None = None,
                    th: Thresholds = Thresholds()) -> Diagnosis:
    """MegaScan on a stored run, fed batch by batch (``inputs.stored_batches``:
    a few whole iterations at a time, a long iteration microbatch by
    microbatch); the run's own scenario unless ``scenario`` is given. Events
    that carry no iteration (a foreign store) are in no batch: such a run is
    fed whole."""
    detector: Detector | None = None
    fed = 0
    for batch in stored_batches(store):
        detector = detector or Detector(batch.gpus_per_node, scenario or batch.scenario, th)
        detector.feed(batch)
        fed += batch.job_events
    if detector is None or fed != stored_events(store):
        whole = load_table_scan(store)
        return megascan(replace(whole, scenario=scenario or whole.scenario), th)
    return detector.verdict()
