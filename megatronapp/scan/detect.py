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
from typing import Any, Hashable, Iterable, Mapping, Sequence, Union

import numpy as np

from megatronapp.trace.kinds import event_kind
from megatronapp.trace.events import Event

from .diagnosis import Diagnosis, RootCause, ranked
from .inputs import ScanInput, stage_peers
from .waits import WaitAccumulator, WaitScores, members_of_ops, with_waits
from .work import Work, modelled_work

MAD_TO_SIGMA = 1.4826
MEDIAN_SE = 1.2533  # standard error of a median = 1.2533·σ/√n for normal data
SIGMA_FLOOR = 1e-3
MIN_DELIVERY_S = 5e-6  # no transport delivers faster: a smaller class floor is clock error


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
    # Real machines add heavy-tailed, one-sided delays (a descheduled
    # process), never speed-ups: a rank's *fastest* runs of an op show its
    # speed. These read low quantiles of durations.
    floor_quantile: float = 5.0  # percent: a rank's floor for an op name
    floor_excess: float = 0.15  # slow at its best in every op it runs, by this much
    min_floor_ops: int = 4  # runs of an op name needed for its floor
    agree_quantile: float = 10.0  # a median-based candidate must be slow here too ...
    agree_share: float = 0.5  # ... by at least this share of its median slowdown
    wait_ratio: float = 3.0  # slow: a link's fastest deliveries this many times its class's
    erratic_ratio: float = 1.5  # erratic: its typical delivery this many times its class's
    z_erratic: float = 2.0  # ... and its waits rank this far above the class's in both directions


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
    rows, medians, spreads = _row_medians(lr)
    # Noise is each row's spread around its own median (a slow rank shifts its
    # whole row, which must not count as noise), pooled by the median.
    pooled = spreads[[len(v) > 0 for v in rows]]
    sigma = max(MAD_TO_SIGMA * float(np.median(pooled)), SIGMA_FLOOR) if len(pooled) else SIGMA_FLOOR
    slow_cut = math.log1p(th.min_excess) + 2 * sigma
    out = {}
    for i, r in enumerate(ranks):
        vals = rows[i]
        if len(vals) == 0:
            continue
        med = float(medians[i])
        z = med / (MEDIAN_SE * sigma / math.sqrt(len(vals)))
        out[r] = (med, z, float(np.mean(vals > slow_cut)), len(vals))
    return out


def _row_medians(lr: np.ndarray) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Each row's finite values, their median and their median absolute
    deviation (NaN for a row with none); one call per statistic when every
    rank ran every op (a simulated job's thousands of ranks)."""
    finite = np.isfinite(lr)
    if finite.all():
        medians = np.median(lr, axis=1)
        return list(lr), medians, np.median(np.abs(lr - medians[:, None]), axis=1)
    rows = [row[ok] for row, ok in zip(lr, finite)]
    medians = np.array([np.median(v) if len(v) else np.nan for v in rows])
    spreads = np.array([np.median(np.abs(v - m)) if len(v) else np.nan
                        for v, m in zip(rows, medians)])
    return rows, medians, spreads


def compute_scores(scan: ScanInput, th: Thresholds, peers: Mapping[int, tuple[int, ...]],
                   work: Work) -> dict[int, ComputeScore]:
    """Stage 1 for every rank; ranks without stage ``peers`` are compared across
    stages, each op's duration per unit of the ``work`` it models where known."""
    tables = {r: per_work(compute_table(ev), work.get(r)) for r, ev in scan.events.items()}
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


def lonely_work(scenario: Any, peers: Mapping[int, tuple[int, ...]]) -> dict[int, dict[str, float]]:
    """The modelled work of ranks without stage peers (compared across
    pipeline stages, which do unequal work), when there are two or more."""
    lonely = [r for r, p in peers.items() if len(p) == 1]
    return modelled_work(scenario, lonely) if len(lonely) >= 2 else {}


def per_work(table: dict[Any, float], work: Mapping[str, float] | None) -> dict[Any, float]:
    """Durations keyed by (op name, ...) divided by the work of their op name."""
    if not work:
        return table
    return {k: v / work[k[0]] if k[0] in work else v for k, v in table.items()}


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


def _durations(events: Iterable[Event]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.dur_s > 0 and event_kind(e.name, e.args) == "compute":
            out[e.name].append(e.dur_s)
    return out


Samples = Union[Sequence[float], np.ndarray]  # per-event lists, or columns
Durations = Mapping[int, Mapping[str, Samples]]  # rank -> op name -> compute durations


def durations_per_work(durations: Mapping[str, Samples], work: Mapping[str, float] | None
                       ) -> Mapping[str, Samples]:
    """Each op name's durations divided by the work it models (``per_work``)."""
    if not work:
        return durations
    return {n: np.asarray(v) / work[n] if n in work else v for n, v in durations.items()}


def durations_of(scan: ScanInput) -> dict[int, dict[str, list[float]]]:
    return {r: _durations(ev) for r, ev in scan.events.items()}


def quantile_ratios(durations: Durations, peers: Mapping[int, tuple[int, ...]], quantile: float,
                    min_ops: int) -> dict[int, dict[str, tuple[float, int]]]:
    """rank -> op name -> (log(its ``quantile`` duration / its peers' median of
    theirs), its runs of that op). Peers: its stage peers, else the other
    peerless ranks (pipeline stages, compared op name by op name)."""
    quantiles = per_run_quantiles(durations, quantile, min_ops)
    lonely = tuple(sorted(r for r, p in peers.items() if len(p) == 1))
    class_of = {r: peers[r] if len(peers[r]) > 1 else lonely for r in quantiles}
    theirs: dict[tuple[int, str], float] = {}  # (rank, name) -> its peers' median quantile
    for cls in set(class_of.values()):
        of_name: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for r in cls:
            for n, (q, _count) in quantiles.get(r, {}).items():
                of_name[n].append((r, q))
        for n, members in of_name.items():
            if len(members) > 1:  # each against the others (a stage holds thousands)
                others = _medians_without_each(np.array([q for _, q in members]))
                theirs.update(((r, n), float(m)) for (r, _q), m in zip(members, others))
    return {r: {n: (math.log(q / theirs[(r, n)]), count) for n, (q, count) in mine.items()
                if (r, n) in theirs} for r, mine in quantiles.items()}


def per_run_quantiles(durations: Durations, quantile: float, min_ops: int
                      ) -> dict[int, dict[str, tuple[float, int]]]:
    """rank -> op name -> (the ``quantile`` of its durations, their count), for
    names run ``min_ops`` times or more. Runs of one length are stacked and
    reduced in one call (a 12,288-rank job has 100,000 of them, mostly alike)."""
    out: dict[int, dict[str, tuple[float, int]]] = {r: {} for r in durations}
    by_length: dict[int, list[tuple[int, str, Samples]]] = defaultdict(list)
    for r, by_name in durations.items():
        for n, v in by_name.items():
            if len(v) >= min_ops:
                by_length[len(v)].append((r, n, v))
    for length, runs in by_length.items():
        values = np.percentile(np.array([np.asarray(v, float) for _, _, v in runs]), quantile,
                               axis=1)
        for (r, n, _), value in zip(runs, values.tolist()):
            out[r][n] = (value, length)
    return out


def floor_scores(durations: Durations, peers: Mapping[int, tuple[int, ...]], quantile: float,
                 min_ops: int) -> dict[int, float]:
    """rank -> the smallest, over the op names it runs, of its floor ratio
    (``quantile_ratios``). A throttled device is slower at everything, at its
    best too; a rank delayed by contention is slow in some ops, not at its
    best in all of them."""
    return {r: min(v for v, _ in by_name.values())
            for r, by_name in quantile_ratios(durations, peers, quantile, min_ops).items()
            if by_name}


def slow_at_quartile_too(durations: Durations, peers: Mapping[int, tuple[int, ...]],
                         th: Thresholds) -> dict[int, bool]:
    """rank -> whether, in most of the runs of the ops where its median is
    slow, its lower quartile is slow too (by ``agree_share`` of the median's
    excess). A slow device stretches every run; contention stretches some."""
    medians = quantile_ratios(durations, peers, 50.0, th.min_floor_ops)
    quartiles = quantile_ratios(durations, peers, th.agree_quantile, th.min_floor_ops)
    out = {}
    for r, by_name in medians.items():
        slow = {n: (m, count) for n, (m, count) in by_name.items() if m > math.log1p(th.min_excess)}
        agreeing = sum(count for n, (m, count) in slow.items()
                       if quartiles[r].get(n, (m, 0))[0] >= th.agree_share * m)
        out[r] = 2 * agreeing >= sum(count for _, count in slow.values())
    return out


def compute_root_causes(scan: ScanInput, th: Thresholds) -> list[RootCause]:
    """Candidates: a rank slow by its matched medians (and at a low quantile
    too, so contention that only stretches some runs is not taken for a slow
    device), or slow at its best in every op it runs. A median-based
    candidate that is rarely the last to arrive at its collectives is a
    victim and is dropped."""
    peers = stage_peers(scan)
    work = lonely_work(scan.scenario, peers)
    durations = {r: durations_per_work(d, work.get(r)) for r, d in durations_of(scan).items()}
    scores = compute_scores(scan, th, peers, work)
    return judge_compute(sorted(scan.events), scores, late_arrivals(scan), durations, peers, th)


def judge_compute(ranks: Iterable[int], scores: Mapping[int, ComputeScore],
                  late: Mapping[int, tuple[int, int]], durations: Durations,
                  peers: Mapping[int, tuple[int, ...]], th: Thresholds) -> list[RootCause]:
    """Each rank judged from its median scores, its durations' quantiles
    against its peers' (``durations``: rank -> op name -> durations) and how
    often it was last to its collectives (``late``: rank -> (last, joined))."""
    floors = floor_scores(durations, peers, th.floor_quantile, th.min_floor_ops)
    consistent = slow_at_quartile_too(durations, peers, th)
    causes = []
    for r in ranks:
        s = scores.get(r)
        by_median = (s is not None and s.log_excess > math.log1p(th.min_excess)
                     and s.z > th.z_compute
                     and consistent.get(r, True))
        by_floor = floors.get(r, 0.0) > math.log1p(th.floor_excess)
        if not (by_median or by_floor):
            continue
        n_last, n_joined = late.get(r, (0, 0))
        share = n_last / n_joined if n_joined else None
        if (not by_floor and share is not None and n_joined >= th.min_collectives
                and share < th.late_share_veto):
            continue  # slow here, but others arrive after it: not the source
        # (slow even at its best is no victim's mark: waiting happens between ops,
        # and on a real machine who arrives last depends on much more than this rank)
        causes.append(_compute_cause(r, s, floors.get(r), by_median, th, n_last, n_joined))
    return causes


def _compute_cause(r: int, s: ComputeScore | None, floor: float | None, by_median: bool,
                   th: Thresholds, n_last: int, n_joined: int) -> RootCause:
    evidence: dict[str, Any] = {"last_to_start": n_last, "collectives": n_joined}
    if s is not None:
        evidence.update(slowdown=round(math.exp(s.log_excess), 4),
                        slow_op_share=round(s.slow_share, 3), ops_compared=s.ops,
                        peers=len(s.peers) - 1, z=round(s.z, 1))
    if floor is not None:
        evidence["floor_slowdown"] = round(math.exp(floor), 4)
    if by_median and s is not None:
        confidence = s.z / (s.z + th.z_compute)
    else:
        excess = floor if floor is not None else 0.0
        confidence = excess / (excess + math.log1p(th.floor_excess))
    return RootCause(r, "compute", None, confidence, evidence)


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
    return judge_links(_bandwidth_causes(scan, th), delivery_waits(scan), scan.gpus_per_node, th)


def judge_links(bandwidth: list[RootCause], waits: Mapping[Channel, Samples],
                gpus_per_node: int, th: Thresholds) -> list[RootCause]:
    """Slow or erratic bandwidth first; a pair it did not name may still be
    slow or erratic to deliver."""
    flagged = {(c.rank, c.peer) for c in bandwidth}
    return bandwidth + [c for c in _delivery_causes(waits, gpus_per_node, th)
                        if (c.rank, c.peer) not in flagged]


def link_class(pair: tuple[int, int], gpus_per_node: int) -> bool:
    return pair[0] // gpus_per_node == pair[1] // gpus_per_node


def _bandwidth_causes(scan: ScanInput, th: Thresholds) -> list[RootCause]:
    """Effective bandwidth per pair against pairs of the same link class."""
    return judge_bandwidth(_pair_stats(transfer_samples(scan), th), scan.gpus_per_node, th)


def judge_bandwidth(stats: Iterable[PairStats], gpus_per_node: int,
                    th: Thresholds) -> list[RootCause]:
    classes: dict[bool, list[PairStats]] = defaultdict(list)
    for p in stats:
        classes[link_class(p.pair, gpus_per_node)].append(p)
    causes = []
    for members in classes.values():
        if len(members) < 3:
            continue  # a class needs a majority of healthy pairs to judge against
        centre = float(np.median([p.median for p in members]))
        typical = max(float(np.median([p.spread for p in members])), SIGMA_FLOOR)
        for p in members:
            causes += judge_pair(p, centre, typical, th)
    return causes


Channel = tuple[tuple[int, int], str]  # (unordered rank pair, direction)


def delivery_waits(scan: ScanInput) -> dict[Channel, list[float]]:
    """(pair, direction) -> how long each receive went on after both sides
    were ready (after its send started, or after it was posted if later).
    The direction (forward, backward, or which way when unnamed) keeps
    a pipeline's two flows apart: they wait for different things."""
    waits: dict[Channel, list[float]] = defaultdict(list)
    for op in scan.ops:
        if op.kind != "p2p":
            continue
        (s, si), (r, ri) = op.members
        send, recv = scan.events[s][si], scan.events[r][ri]
        direction = flow_of(send.name) or ("up" if s < r else "down")
        waits[((min(s, r), max(s, r)), direction)].append(
            max(recv.end_s - max(send.start_s, recv.start_s), 0.0))
    return waits


def flow_of(name: str) -> str:
    """A transfer's flow from its name: ``send_forward`` -> ``forward`` ("" if unnamed)."""
    lowered = name.lower()
    for role in ("send", "recv"):
        if role in lowered:
            return lowered.replace(role, "", 1).strip("_")
    return ""


def rank_sum_z(sample: np.ndarray, reference: np.ndarray) -> float:
    """Mann-Whitney: how many standard errors ``sample`` ranks above
    ``reference`` (no assumption on how the waits are distributed)."""
    ranks = _average_ranks(np.concatenate([sample, reference]))
    return _rank_sum_to_z(float(ranks[:len(sample)].sum()), len(sample), len(reference))


def _average_ranks(values: np.ndarray) -> np.ndarray:
    # tied waits share their average rank (equal waits favour neither side)
    _, which, counts = np.unique(values, return_inverse=True, return_counts=True)
    return (np.cumsum(counts) - (counts - 1) / 2)[which]


def _rank_sum_to_z(rank_sum: float, n1: int, n2: int) -> float:
    u = rank_sum - n1 * (n1 + 1) / 2
    return (u - n1 * n2 / 2) / math.sqrt(n1 * n2 * (n1 + n2 + 1) / 12)


@dataclass(frozen=True)
class Delivery:
    """One direction of one pair against the same direction of its link class."""

    floor_ratio: float
    median_ratio: float
    z: float  # rank-sum z of its waits against the class's
    transfers: int


def _deliveries(all_waits: Mapping[Channel, Samples], node: int,
                th: Thresholds) -> dict[tuple[int, int], list[Delivery]]:
    """Each channel against the other channels of its class (same direction,
    same link class), class by class: its class's floor and median leave the
    channel out, and one ranking of the class's waits serves every rank-sum
    (linear in channels, not quadratic: a 12,288-GPU job has tens of thousands)."""
    classes: dict[tuple[str, bool], list[tuple[tuple[int, int], np.ndarray]]] = defaultdict(list)
    for (pair, direction), w in sorted(all_waits.items()):
        if len(w) >= th.min_transfers:
            classes[(direction, link_class(pair, node))].append((pair, np.asarray(w)))
    out: dict[tuple[int, int], list[Delivery]] = defaultdict(list)
    for members in classes.values():
        if len(members) < 2:
            continue
        floors, medians = _floors_and_medians([w for _, w in members], th.floor_quantile)
        class_floor, class_median = _medians_without_each(floors), _medians_without_each(medians)
        for i, ((pair, mine), z) in enumerate(zip(members, _rank_sum_zs([w for _, w in members]))):
            out[pair].append(Delivery(
                floors[i] / max(class_floor[i], MIN_DELIVERY_S),
                medians[i] / max(class_median[i], MIN_DELIVERY_S), z, len(mine)))
    return out


def _floors_and_medians(samples: list[np.ndarray], q: float) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's ``q``-th percentile and median: one call over a matrix per
    sample length (channels of one class mostly carry as many transfers)."""
    floors, medians = np.empty(len(samples)), np.empty(len(samples))
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, w in enumerate(samples):
        by_length[len(w)].append(i)
    for members in by_length.values():
        stacked = np.stack([samples[i] for i in members])
        floors[members] = np.percentile(stacked, q, axis=1)
        medians[members] = np.median(stacked, axis=1)
    return floors, medians


def _medians_without_each(values: np.ndarray) -> np.ndarray:
    """For each i, the median of ``values`` without its i-th (at least 2 values)."""
    order = np.argsort(values, kind="stable")
    v = values[order]
    n = len(v) - 1  # values left
    place = np.empty(len(v), np.int64)
    place[order] = np.arange(len(v))

    def kth(k: int) -> np.ndarray:  # k-th smallest once each one is left out
        return np.where(k < place, v[k], v[np.minimum(k + 1, len(v) - 1)])

    if n % 2:
        return kth(n // 2).astype(float)
    return (kth(n // 2 - 1) + kth(n // 2)) / 2


def _rank_sum_zs(samples: list[np.ndarray]) -> list[float]:
    """``rank_sum_z`` of each sample against all the others together: the
    others and the sample make the whole class, so one ranking serves all."""
    ranks = _average_ranks(np.concatenate(samples))
    cuts = np.cumsum([0] + [len(w) for w in samples])
    return [_rank_sum_to_z(float(ranks[lo:hi].sum()), int(hi - lo), int(len(ranks) - (hi - lo)))
            for lo, hi in zip(cuts[:-1], cuts[1:])]


def _delivery_causes(waits: Mapping[Channel, Samples], gpus_per_node: int,
                     th: Thresholds) -> list[RootCause]:
    """Each pair against the other pairs of its link class, direction by
    direction, keeping the pair's least striking direction (a faulty link
    delays both): slow if its fastest deliveries are late (waiting on a busy
    receiver only ever adds time, so fast deliveries are clean), erratic if
    its typical delivery is, and its waits rank above the class's beyond
    what a busy machine's noise makes of them."""
    causes = []
    for pair, per_direction in _deliveries(waits, gpus_per_node, th).items():
        floor_ratio = min(d.floor_ratio for d in per_direction)
        median_ratio = min(d.median_ratio for d in per_direction)
        z = min(d.z for d in per_direction)
        evidence: dict[str, Any] = {
            "transfers": sum(d.transfers for d in per_direction),
            "delivery_floor_ratio": round(floor_ratio, 2),
            "delivery_median_ratio": round(median_ratio, 2), "z": round(z, 1)}
        if floor_ratio > th.wait_ratio:
            causes.append(RootCause(pair[0], "link", pair[1], floor_ratio / (floor_ratio + th.wait_ratio),
                                    {"problem": "slow", **evidence}))
        elif median_ratio > th.erratic_ratio and z > th.z_erratic:
            causes.append(RootCause(pair[0], "link", pair[1],
                                    median_ratio / (median_ratio + th.erratic_ratio),
                                    {"problem": "erratic", **evidence}))
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


def wait_scores(scan: ScanInput) -> WaitScores:
    """Who waited for whom at the linked sync ops (``waits``)."""
    waits = WaitAccumulator()
    waits.feed(*members_of_ops(scan.events, [(op.kind, op.members) for op in scan.ops]))
    return waits.scores()


def megascan(scan: ScanInput, th: Thresholds = Thresholds()) -> Diagnosis:
    causes = with_waits(compute_root_causes(scan, th) + link_root_causes(scan, th),
                        wait_scores(scan), durations_of(scan))
    return Diagnosis(ranked(causes), victims_of(scan, causes))
