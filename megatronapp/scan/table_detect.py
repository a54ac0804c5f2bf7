"""MegaScan's detector (``detect.megascan``) over a ``TableScan``, vectorised."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from megatronapp.trace.metrics import group_ids

from .detect import (MAD_TO_SIGMA, Channel, ComputeScore, PairStats, Thresholds,
                     durations_per_work, flow_of, judge_bandwidth, judge_compute, judge_links,
                     lonely_work, relative_to_peers, row_scores)
from .work import Work
from .diagnosis import Diagnosis, RootCause, ranked
from .inputs import STAGE_PEER_WORDS
from .table import COLLECTIVE, COMPUTE_KIND, P2P, TableScan
from .waits import COLLECTIVE_KIND, P2P_KIND, RECEIVE, WaitAccumulator, WaitScores, with_waits

LATE_WORDS = ("tp", "dp", "tensor", "data")


def _first_word_in(names: tuple[str, ...], words: tuple[str, ...]) -> np.ndarray:
    return np.array([n.lower().split("_")[0] in words for n in names] + [False])


# ------------------------------------------------------------ stage peers
def stage_peers(scan: TableScan) -> dict[int, tuple[int, ...]]:
    """``inputs.stage_peers``: ranks joined by TP/DP collectives run the same compute."""
    sync, cols = scan.sync, scan.cols
    ranks = np.unique(cols.rank).astype(np.int64)
    parent = {int(r): int(r) for r in ranks}

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    word = _first_word_in(cols.names, STAGE_PEER_WORDS)
    ops = (sync.op_kind == COLLECTIVE) & word[sync.op_name.astype(np.int64)]
    keep = ops[sync.member_op]
    op, rank = sync.member_op[keep], cols.rank[sync.member_row[keep]].astype(np.int64)
    same = op[1:] == op[:-1]  # consecutive members of one op: one edge each
    width = int(ranks.max()) + 1 if len(ranks) else 1
    edges = np.unique(rank[:-1][same] * width + rank[1:][same])
    for a, b in zip((edges // width).tolist(), (edges % width).tolist()):
        parent[find(b)] = find(a)
    classes: dict[int, list[int]] = {}
    for r in ranks.tolist():
        classes.setdefault(find(r), []).append(r)
    return {r: tuple(classes[find(r)]) for r in ranks.tolist()}


# --------------------------------------------------------------- stage 1
def _compute_keys(scan: TableScan) -> tuple[np.ndarray, np.ndarray]:
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
                logdur: np.ndarray) -> np.ndarray:
    """``detect._log_ratios``: rows = ranks, columns = keys on 2+ of them."""
    sorted_ranks = np.array(ranks, np.int64)
    position = np.argsort(sorted_ranks)
    mine = np.isin(rank_of_row, sorted_ranks)
    r_idx = position[np.searchsorted(sorted_ranks[position], rank_of_row[mine])]
    k = key[mine]
    counts = np.bincount(k) if len(k) else np.zeros(0, np.int64)
    shared = np.flatnonzero(counts >= 2)
    col_of = np.full(len(counts), -1, np.int64)
    col_of[shared] = np.arange(len(shared))
    logd = np.full((len(ranks), len(shared)), np.nan)
    ok = col_of[k] >= 0
    logd[r_idx[ok], col_of[k][ok]] = logdur[mine][ok]
    return relative_to_peers(logd)


def compute_scores(scan: TableScan, th: Thresholds, peers: dict[int, tuple[int, ...]],
                   work: Work) -> dict[int, ComputeScore]:
    """``detect.compute_scores``, ``work`` that of the ranks without stage peers."""
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
    scores: dict[int, ComputeScore] = {}
    for i, cls in enumerate(classes):
        mine = order[cuts[i]:cuts[i + 1]]
        ranks = list(cls)
        lr = _log_ratios(ranks, rank_of_row[mine], key[mine], logdur[mine])
        for r, (med, z, share, n) in row_scores(ranks, lr, th).items():
            scores[r] = ComputeScore(r, med, z, share, n, cls)
    if len(lonely) >= 2:
        scores.update(_cross_stage(lonely, rows, rank_of_row, key, logdur, scan, th))
    return scores


def _cross_stage(ranks: list[int], rows: np.ndarray, rank_of_row: np.ndarray, key: np.ndarray,
                 logdur: np.ndarray, scan: TableScan, th: Thresholds) -> dict[int, ComputeScore]:
    """``detect._cross_stage_scores``: op name by op name, a rank's middle score."""
    name = scan.cols.name[rows]
    per_rank: dict[int, list[ComputeScore]] = {}
    for code in sorted(np.unique(name).tolist(), key=lambda c: scan.cols.names[c]):
        mine = name == code
        lr = _log_ratios(ranks, rank_of_row[mine], key[mine], logdur[mine])
        for r, (med, z, share, n) in row_scores(ranks, lr, th).items():
            if n >= 2:
                per_rank.setdefault(r, []).append(ComputeScore(r, med, z, share, n, tuple(ranks)))
    return {r: sorted(s, key=lambda c: c.z)[(len(s) - 1) // 2] for r, s in per_rank.items()}


# --------------------------------------------------------------- stage 2
def late_arrivals(scan: TableScan) -> dict[int, tuple[int, int]]:
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


def durations_of(scan: TableScan) -> dict[int, dict[str, np.ndarray]]:
    """``detect.durations_of``: rank -> op name -> its compute durations."""
    c = scan.cols
    rows = np.flatnonzero((c.kind == COMPUTE_KIND) & (c.dur_s > 0))
    group, n = group_ids(c.rank[rows], c.name[rows])
    order = np.argsort(group, kind="stable")
    cuts = np.r_[0, np.flatnonzero(np.diff(group[order])) + 1, len(order)]
    out: dict[int, dict[str, np.ndarray]] = {}
    for i in range(n):
        idx = rows[order[cuts[i]:cuts[i + 1]]]
        out.setdefault(int(c.rank[idx[0]]), {})[c.names[int(c.name[idx[0]])]] = c.dur_s[idx]
    return out


def _log_work(scan: TableScan, rows: np.ndarray, work: Work) -> np.ndarray:
    """log of the work each row's op models (0 where unknown): ``detect.per_work``."""
    out = np.zeros(len(rows))
    c = scan.cols
    for rank, by_name in work.items():
        for name, w in by_name.items():
            code = c.name_code(name)
            out[(c.rank[rows] == rank) & (c.name[rows] == code)] = np.log(w)
    return out


def compute_root_causes(scan: TableScan, th: Thresholds) -> list[RootCause]:
    ranks = np.unique(scan.cols.rank).astype(np.int64).tolist()
    peers = stage_peers(scan)
    work = lonely_work(scan.scenario, peers)
    durations = {r: durations_per_work(d, work.get(r)) for r, d in durations_of(scan).items()}
    return judge_compute(ranks, compute_scores(scan, th, peers, work), late_arrivals(scan), durations,
                         peers, th)


# --------------------------------------------------------------- stage 3
def pair_stats(scan: TableScan, th: Thresholds) -> list[PairStats]:
    """``detect._pair_stats`` of ``detect.transfer_samples``: log(seconds per byte)
    of each transfer, per unordered rank pair."""
    sync, cols = scan.sync, scan.cols
    p2p = np.flatnonzero((sync.op_kind == P2P) & (sync.op_bytes > 0))
    send, recv = sync.sender[p2p], sync.receiver[p2p]
    seconds = np.where(cols.dur_s[recv] > 0, np.minimum(cols.dur_s[send], cols.dur_s[recv]),
                       cols.dur_s[send])
    ok = seconds > 0
    a, b = cols.rank[send][ok].astype(np.int64), cols.rank[recv][ok].astype(np.int64)
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    value = np.log(seconds[ok] / sync.op_bytes[p2p][ok])
    pair, n_pairs = group_ids(lo, hi)
    out = []
    order = np.argsort(pair, kind="stable")
    cuts = np.r_[0, np.flatnonzero(np.diff(pair[order])) + 1, len(order)]
    for i in range(n_pairs):
        idx = order[cuts[i]:cuts[i + 1]]
        if len(idx) < th.min_transfers:
            continue
        v = value[idx]
        med = float(np.median(v))
        out.append(PairStats((int(lo[idx[0]]), int(hi[idx[0]])), med,
                             MAD_TO_SIGMA * float(np.median(np.abs(v - med))), len(v)))
    return out


def delivery_waits(scan: TableScan) -> dict[Channel, np.ndarray]:
    """``detect.delivery_waits``: per (pair, direction), how long each receive
    went on after both sides were ready."""
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
    channel, n = group_ids(lo, hi, which)
    order = np.argsort(channel, kind="stable")
    cuts = np.r_[0, np.flatnonzero(np.diff(channel[order])) + 1, len(order)]
    out: dict[Channel, np.ndarray] = {}
    for i in range(n):
        idx = order[cuts[i]:cuts[i + 1]]
        j = idx[0]
        out[((int(lo[j]), int(hi[j])), str(codes[which[j]]))] = wait[idx]
    return out


def link_root_causes(scan: TableScan, th: Thresholds) -> list[RootCause]:
    node = scan.gpus_per_node
    return judge_links(judge_bandwidth(pair_stats(scan, th), node, th), delivery_waits(scan),
                       node, th)


# ------------------------------------------------------------- detector
def victims_of(scan: TableScan, causes: list[RootCause]) -> tuple[int, ...]:
    sources = np.array(sorted({c.rank for c in causes if c.kind == "compute"}), np.int64)
    if not len(sources):
        return ()
    rank = scan.cols.rank[scan.sync.member_row].astype(np.int64)
    touched = np.unique(scan.sync.member_op[np.isin(rank, sources)])
    waited = set(np.unique(rank[np.isin(scan.sync.member_op, touched)]).tolist())
    named = {c.rank for c in causes} | {c.peer for c in causes}
    return tuple(sorted(waited - named))


def wait_scores(scan: TableScan) -> WaitScores:
    """``detect.wait_scores``: the sync table's member rows, each with its op."""
    sync = scan.sync
    p2p = sync.op_kind[sync.member_op] == P2P
    receiving = sync.member_row == sync.receiver[sync.member_op]
    members = replace(scan.cols.take(sync.member_row),
                      kind=np.where(p2p, P2P_KIND, COLLECTIVE_KIND).astype(np.int8),
                      role=np.where(p2p, np.where(receiving, RECEIVE, 1 - RECEIVE), -1
                                    ).astype(np.int8))
    waits = WaitAccumulator()
    waits.feed(members, sync.member_op.astype(np.int64))
    return waits.scores()


def megascan_table(scan: TableScan, th: Thresholds = Thresholds()) -> Diagnosis:
    causes = with_waits(compute_root_causes(scan, th) + link_root_causes(scan, th),
                        wait_scores(scan), durations_of(scan))
    return Diagnosis(ranked(causes), victims_of(scan, causes))
