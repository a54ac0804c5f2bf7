"""MegaScan's root-cause detector: the paper's multi-stage heuristic, measured.

1. Compare every compute op with the same op on the ranks doing identical work
   (same pp stage: its TP and DP peers). A rank whose ops are consistently
   slower than its peers' (median log-ratio, judged against the run's own
   noise) is a candidate.
2. Within TP/DP collectives the true source *starts* late (it arrives last);
   its peers wait and only look slow. A candidate that is rarely the last to
   arrive is a victim of something else and is dropped.
3. Point-to-point effective bandwidth (bytes / transfer time) per rank pair,
   against pairs of the same link class: a slow or erratic link.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Hashable, Iterable

import numpy as np

from megatronapp.kinds import event_kind
from megatronapp.tracer import Event

from .diagnosis import Diagnosis, RootCause, ranked
from .inputs import ScanInput, stage_peers

MAD_TO_SIGMA = 1.4826
MEDIAN_SE = 1.2533  # standard error of a median = 1.2533·σ/√n for normal data
SIGMA_FLOOR = 1e-3


@dataclass(frozen=True)
class Thresholds:
    min_excess: float = 0.03  # slowdowns under 3% are not worth a page
    z_compute: float = 6.0
    late_share_veto: float = 0.5  # candidates last to arrive less often than this are victims
    min_collectives: int = 3
    link_excess: float = 0.25  # pair's time per byte this much above its link class
    z_link: float = 6.0
    jitter_ratio: float = 3.0  # pair's spread this many times the class's typical spread
    jitter_floor: float = 0.15  # ... and at least this (log units)
    min_transfers: int = 4


@dataclass(frozen=True)
class ComputeScore:
    rank: int
    log_excess: float  # median over ops of log(duration / peers' duration)
    z: float
    slow_share: float
    ops: int
    peers: tuple[int, ...]


# --------------------------------------------------------------- stage 1
def compute_table(events: Iterable[Event]) -> dict[tuple[Hashable, ...], float]:
    """op key (name, iteration, microbatch, chunk, occurrence) -> duration."""
    seen: dict[tuple[Hashable, ...], int] = defaultdict(int)
    table: dict[tuple[Hashable, ...], float] = {}
    for e in events:
        if e.dur_s <= 0 or event_kind(e.name, e.args) != "compute":
            continue
        base = (e.name, e.args.get("iteration"), e.args.get("microbatch"), e.args.get("chunk"))
        table[base + (seen[base],)] = e.dur_s
        seen[base] += 1
    return table


def _log_ratios(ranks: list[int], tables: dict[int, dict]) -> np.ndarray:
    """rows = ranks, columns = ops present on 2+ ranks: log(duration / peers' median)."""
    counts: dict[Hashable, int] = defaultdict(int)
    for r in ranks:
        for key in tables[r]:
            counts[key] += 1
    keys = [k for k, n in counts.items() if n >= 2]
    logd = np.full((len(ranks), len(keys)), np.nan)
    for i, r in enumerate(ranks):
        table = tables[r]
        logd[i] = [math.log(table[k]) if k in table else np.nan for k in keys]
    return relative_to_peers(logd)


def relative_to_peers(logd: np.ndarray) -> np.ndarray:
    """Each row (a rank's log durations per op) minus its peers' median per op."""
    if len(logd) >= 5:
        return logd - np.nanmedian(logd, axis=0)
    out = np.empty_like(logd)
    for i in range(len(logd)):  # leave-one-out: with few peers a rank must not vote for itself
        others = np.delete(logd, i, axis=0)
        out[i] = logd[i] - np.nanmedian(others, axis=0)
    return out


def row_scores(ranks: list[int], lr: np.ndarray, th: Thresholds) -> dict[int, tuple[float, float, float, int]]:
    if lr.size == 0:
        return {}
    # Noise is each row's spread around its own median (a slow rank shifts its
    # whole row, which must not count as noise), pooled by the median.
    spreads = [np.median(np.abs(v - np.median(v))) for v in (row[np.isfinite(row)] for row in lr)
               if len(v)]
    sigma = max(MAD_TO_SIGMA * float(np.median(spreads)), SIGMA_FLOOR) if spreads else SIGMA_FLOOR
    slow_cut = math.log1p(th.min_excess) + 2 * sigma
    out = {}
    for i, r in enumerate(ranks):
        vals = lr[i][np.isfinite(lr[i])]
        if len(vals) == 0:
            continue
        med = float(np.median(vals))
        z = med / (MEDIAN_SE * sigma / math.sqrt(len(vals)))
        out[r] = (med, z, float(np.mean(vals > slow_cut)), len(vals))
    return out


def compute_scores(scan: ScanInput, th: Thresholds) -> dict[int, ComputeScore]:
    """Stage 1 for every rank; ranks without stage peers are compared across stages."""
    tables = {r: compute_table(ev) for r, ev in scan.events.items()}
    peers = stage_peers(scan)
    classes = {p for p in peers.values() if len(p) > 1}
    lonely = sorted(r for r, p in peers.items() if len(p) == 1)
    scores: dict[int, ComputeScore] = {}
    for cls in classes:
        ranks = list(cls)
        for r, (med, z, share, n) in row_scores(ranks, _log_ratios(ranks, tables), th).items():
            scores[r] = ComputeScore(r, med, z, share, n, cls)
    if len(lonely) >= 2:
        scores.update(_cross_stage_scores(lonely, tables, th))
    return scores


def _cross_stage_scores(ranks: list[int], tables: dict[int, dict], th: Thresholds) -> dict[int, ComputeScore]:
    """Pipeline stages differ (the last one computes the logits): judge each op
    name apart and keep a rank's middle name (the lower one of two), so only a
    rank slow at most of what it does stands out, not one stage's extra work."""
    names = {k[0] for r in ranks for k in tables[r]}
    per_rank: dict[int, list[ComputeScore]] = defaultdict(list)
    for name in sorted(names):
        by_name = {r: {k: v for k, v in tables[r].items() if k[0] == name} for r in ranks}
        for r, (med, z, share, n) in row_scores(ranks, _log_ratios(ranks, by_name), th).items():
            if n >= 2:
                per_rank[r].append(ComputeScore(r, med, z, share, n, tuple(ranks)))
    return {r: sorted(s, key=lambda c: c.z)[(len(s) - 1) // 2] for r, s in per_rank.items()}


# --------------------------------------------------------------- stage 2
def late_arrivals(scan: ScanInput) -> dict[int, tuple[int, int]]:
    """rank -> (times it was the last to start a TP/DP collective, collectives joined)."""
    last: dict[int, int] = defaultdict(int)
    joined: dict[int, int] = defaultdict(int)
    for op in scan.ops:
        if op.kind != "collective" or len(op.members) < 2:
            continue
        if op.name.lower().split("_")[0] not in ("tp", "dp", "tensor", "data"):
            continue
        starts = [(scan.events[r][i].start_s, r) for r, i in op.members]
        last[max(starts)[1]] += 1
        for _, r in starts:
            joined[r] += 1
    return {r: (last.get(r, 0), n) for r, n in joined.items()}


def compute_root_causes(scan: ScanInput, th: Thresholds) -> list[RootCause]:
    return judge_compute(compute_scores(scan, th), late_arrivals(scan), th)


def judge_compute(scores: dict[int, ComputeScore], late: dict[int, tuple[int, int]],
                  th: Thresholds) -> list[RootCause]:
    """Slow ranks that are also late to their collectives (``late``: rank ->
    (times last to start, collectives joined))."""
    causes = []
    for r, s in scores.items():
        if s.log_excess <= math.log1p(th.min_excess) or s.z <= th.z_compute:
            continue
        n_last, n_joined = late.get(r, (0, 0))
        share = n_last / n_joined if n_joined else None
        if share is not None and n_joined >= th.min_collectives and share < th.late_share_veto:
            continue  # slow here, but others arrive after it: not the source
        causes.append(RootCause(r, "compute", None, s.z / (s.z + th.z_compute), {
            "slowdown": round(math.exp(s.log_excess), 4), "slow_op_share": round(s.slow_share, 3),
            "ops_compared": s.ops, "peers": len(s.peers) - 1, "z": round(s.z, 1),
            "last_to_start": n_last, "collectives": n_joined}))
    return causes


# --------------------------------------------------------------- stage 3
def transfer_samples(scan: ScanInput) -> dict[tuple[int, int], list[float]]:
    """Unordered rank pair -> log(seconds per byte) of each point-to-point transfer."""
    samples: dict[tuple[int, int], list[float]] = defaultdict(list)
    for op in scan.ops:
        if op.kind != "p2p" or op.nbytes <= 0:
            continue
        (s, si), (r, ri) = op.members
        send, recv = scan.events[s][si], scan.events[r][ri]
        seconds = min(send.dur_s, recv.dur_s) if recv.dur_s > 0 else send.dur_s
        if seconds > 0:
            samples[(min(s, r), max(s, r))].append(math.log(seconds / op.nbytes))
    return samples


@dataclass(frozen=True)
class PairStats:
    pair: tuple[int, int]
    median: float
    spread: float
    n: int


def _pair_stats(samples: dict[tuple[int, int], list[float]], th: Thresholds) -> list[PairStats]:
    out = []
    for pair, vals in samples.items():
        if len(vals) < th.min_transfers:
            continue
        v = np.asarray(vals)
        med = float(np.median(v))
        out.append(PairStats(pair, med, MAD_TO_SIGMA * float(np.median(np.abs(v - med))), len(v)))
    return out


def link_root_causes(scan: ScanInput, th: Thresholds) -> list[RootCause]:
    stats = _pair_stats(transfer_samples(scan), th)
    node = scan.gpus_per_node
    classes: dict[bool, list[PairStats]] = defaultdict(list)
    for p in stats:
        classes[p.pair[0] // node == p.pair[1] // node].append(p)
    causes = []
    for members in classes.values():
        if len(members) < 3:
            continue  # a class needs a majority of healthy pairs to judge against
        centre = float(np.median([p.median for p in members]))
        typical = max(float(np.median([p.spread for p in members])), SIGMA_FLOOR)
        for p in members:
            causes += judge_pair(p, centre, typical, th)
    return causes


def judge_pair(p: PairStats, centre: float, typical: float, th: Thresholds) -> list[RootCause]:
    excess = p.median - centre
    z = excess / (MEDIAN_SE * max(p.spread, typical) / math.sqrt(p.n))
    evidence: dict[str, Any] = {"transfers": p.n, "bandwidth_ratio": round(math.exp(-excess), 3),
                                "spread": round(p.spread, 3), "class_spread": round(typical, 3)}
    if excess > math.log1p(th.link_excess) and z > th.z_link:
        return [RootCause(p.pair[0], "link", p.pair[1], z / (z + th.z_link),
                          {"problem": "slow", "z": round(z, 1), **evidence})]
    ratio = p.spread / typical
    if p.spread > th.jitter_floor and ratio > th.jitter_ratio:
        return [RootCause(p.pair[0], "link", p.pair[1], ratio / (ratio + th.jitter_ratio),
                          {"problem": "erratic", **evidence})]
    return []


# ------------------------------------------------------------- detector
def victims_of(scan: ScanInput, causes: list[RootCause]) -> tuple[int, ...]:
    """Ranks that share a sync op with a compute root cause (they waited for it)."""
    sources = {c.rank for c in causes if c.kind == "compute"}
    waited: set[int] = set()
    for op in scan.ops:
        ranks = set(op.ranks)
        if ranks & sources:
            waited |= ranks
    return tuple(sorted(waited - {c.rank for c in causes} - {c.peer for c in causes}))


def megascan(scan: ScanInput, th: Thresholds = Thresholds()) -> Diagnosis:
    causes = compute_root_causes(scan, th) + link_root_causes(scan, th)
    return Diagnosis(ranked(causes), victims_of(scan, causes))
