"""How MegaScan judges what it measured: the statistics and thresholds that
turn per-rank scores, duration quantiles, late arrivals, transfer rates and
delivery waits into root causes (``detect`` measures them over columns).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence, Union

import numpy as np

from megatronapp.scan.diagnosis import RootCause
from megatronapp.scan.ingest.work import ModelledWork

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


def relative_to_peers(logd: np.ndarray, weight: np.ndarray | None = None) -> np.ndarray:
    """Each row (a rank's log durations per op) minus its peers' median per op;
    row i counted ``weight[i]`` times (ranks it stands for; default once)."""
    if weight is not None and (weight != 1).any():
        return _relative_to_weighted_peers(logd, weight)
    if len(logd) >= 5:
        return logd - np.nanmedian(logd, axis=0)
    out = np.empty_like(logd)
    for i in range(len(logd)):  # leave-one-out: with few peers a rank must not vote for itself
        others = np.delete(logd, i, axis=0)
        out[i] = logd[i] - np.nanmedian(others, axis=0)
    return out


def _relative_to_weighted_peers(logd: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``relative_to_peers`` of the rows repeated by ``weight``, read off each
    row's first copy (without repeating them, but where so few that each
    leaves itself out)."""
    if weight.sum() < 5:
        first = np.cumsum(weight) - weight
        return relative_to_peers(np.repeat(logd, weight, axis=0))[first]
    return logd - weighted_nanmedian(logd, weight)


def weighted_nanmedian(values: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Per column, ``np.nanmedian`` of the rows repeated by ``weight``, as numpy
    computes it (the two middle values' sum halved)."""
    order = np.argsort(values, axis=0, kind="stable")  # NaNs last
    v = np.take_along_axis(values, order, axis=0)
    counted = np.cumsum(np.where(np.isnan(v), 0, weight[order]), axis=0)
    n = counted[-1] if len(v) else np.zeros(values.shape[1], np.int64)
    column = np.arange(values.shape[1])
    low = v[np.argmax(counted > (n - 1) // 2, axis=0), column]
    high = v[np.argmax(counted > n // 2, axis=0), column]
    return np.where(n > 0, (low + high) / 2, np.nan)


def row_scores(ranks: Sequence[int], rows: Sequence[np.ndarray], th: Thresholds
               ) -> dict[int, tuple[float, float, float, int]]:
    """rank -> (median, z, slow share, count) of its row of log ratios to its
    peers (``rows[i]``: rank ``ranks[i]``'s finite values)."""
    if not any(len(v) for v in rows):
        return {}
    medians, spreads = row_medians(rows)
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


def finite_rows(lr: np.ndarray) -> list[np.ndarray]:
    """Each row's finite values (the ops a rank ran)."""
    finite = np.isfinite(lr)
    return list(lr) if finite.all() else [row[ok] for row, ok in zip(lr, finite)]


def distinct(samples: Sequence[Any]) -> tuple[list[int], np.ndarray]:
    """The index of the first of each distinct object in ``samples`` and, per
    sample, which of those it is: twin ranks share their samples' arrays
    (``Reservoirs.aliased``), reduced once each."""
    first: dict[int, int] = {}
    which = np.array([first.setdefault(id(v), i) for i, v in enumerate(samples)], np.int64)
    firsts = sorted(first.values())
    return firsts, np.searchsorted(np.array(firsts, np.int64), which)


def row_medians(rows: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Each row's median and median absolute deviation (NaN for an empty row);
    rows of one length are stacked and reduced in one call (a simulated job's
    thousands of ranks run the same ops), each distinct row once."""
    firsts, which = distinct(rows)
    medians, spreads = np.full(len(firsts), np.nan), np.full(len(firsts), np.nan)
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, first in enumerate(firsts):
        if len(rows[first]):
            by_length[len(rows[first])].append(i)
    for members in by_length.values():
        stacked = np.stack([rows[firsts[i]] for i in members])
        m = np.median(stacked, axis=1)
        medians[members], spreads[members] = m, np.median(np.abs(stacked - m[:, None]), axis=1)
    return medians[which], spreads[which]


def lonely_work(work: ModelledWork, peers: Mapping[int, tuple[int, ...]]
                ) -> dict[int, dict[str, float]]:
    """The modelled work of ranks without stage peers (compared across
    pipeline stages, which do unequal work), when there are two or more."""
    lonely = [r for r, p in peers.items() if len(p) == 1]
    return work(lonely) if len(lonely) >= 2 else {}


Samples = Union[Sequence[float], np.ndarray]  # per-event lists, or columns
Durations = Mapping[int, Mapping[str, Samples]]  # rank -> op name -> compute durations


def durations_per_work(durations: Mapping[str, Samples], work: Mapping[str, float] | None
                       ) -> Mapping[str, Samples]:
    """Each op name's durations divided by the work it models (``per_work``)."""
    if not work:
        return durations
    return {n: np.asarray(v) / work[n] if n in work else v for n, v in durations.items()}


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
                others = medians_without_each(np.array([q for _, q in members]))
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
        firsts, which = distinct([v for _, _, v in runs])
        values = np.percentile(np.array([np.asarray(runs[i][2], float) for i in firsts]),
                               quantile, axis=1)[which]
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


@dataclass(frozen=True)
class PairStats:
    pair: tuple[int, int]
    median: float
    spread: float
    n: int


def judge_links(bandwidth: list[RootCause], waits: Mapping[Channel, Samples],
                gpus_per_node: int, th: Thresholds) -> list[RootCause]:
    """Slow or erratic bandwidth first; a pair it did not name may still be
    slow or erratic to deliver."""
    flagged = {(c.rank, c.peer) for c in bandwidth}
    return bandwidth + [c for c in _delivery_causes(waits, gpus_per_node, th)
                        if (c.rank, c.peer) not in flagged]


def link_class(pair: tuple[int, int], gpus_per_node: int) -> bool:
    return pair[0] // gpus_per_node == pair[1] // gpus_per_node


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


def _average_ranks(values: np.ndarray, times: np.ndarray | None = None) -> np.ndarray:
    """Each value's rank among ``values``, each counted ``times`` over (default once)."""
    # tied waits share their average rank (equal waits favour neither side)
    _, which, counts = np.unique(values, return_inverse=True, return_counts=True)
    if times is not None:
        counts = np.bincount(which, times, minlength=len(counts)).astype(np.int64)
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
        class_floor, class_median = medians_without_each(floors), medians_without_each(medians)
        for i, ((pair, mine), z) in enumerate(zip(members, _rank_sum_zs([w for _, w in members]))):
            out[pair].append(Delivery(
                floors[i] / max(class_floor[i], MIN_DELIVERY_S),
                medians[i] / max(class_median[i], MIN_DELIVERY_S), z, len(mine)))
    return out


def _floors_and_medians(samples: list[np.ndarray], q: float) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's ``q``-th percentile and median: one call over a matrix per
    sample length (channels of one class mostly carry as many transfers)."""
    firsts, which = distinct(samples)
    floors, medians = np.empty(len(firsts)), np.empty(len(firsts))
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, first in enumerate(firsts):
        by_length[len(samples[first])].append(i)
    for members in by_length.values():
        stacked = np.stack([samples[firsts[i]] for i in members])
        floors[members] = np.percentile(stacked, q, axis=1)
        medians[members] = np.median(stacked, axis=1)
    return floors[which], medians[which]


def medians_without_each(values: np.ndarray) -> np.ndarray:
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
    others and the sample make the whole class, so one ranking serves all
    (each distinct sample ranked once, counted as often as it is given)."""
    firsts, which = distinct(samples)
    times = np.bincount(which, minlength=len(firsts))
    kept = [samples[i] for i in firsts]
    ranks = _average_ranks(np.concatenate(kept), np.repeat(times, [len(w) for w in kept]))
    cuts = np.cumsum([0] + [len(w) for w in kept])
    total = int(np.dot(times, np.diff(cuts)))
    zs = [_rank_sum_to_z(float(ranks[lo:hi].sum()), int(hi - lo), total - int(hi - lo))
          for lo, hi in zip(cuts[:-1], cuts[1:])]
    return [zs[i] for i in which]


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

