"""Sync ops and clock alignment over event columns, vectorised for traces of
millions of events (a 12,288-GPU iteration): the one ``fit_clocks`` and
``apply_clocks`` every input goes through (``inputs.prepare_columns``).

Sync ops are linked as ``deps.reconstruct`` links events (same keys), over a
table whose rows are grouped by rank and ordered by (start, -duration)
within a rank, as the trace loader orders events; ranks whose anchor fit
cannot stand are solved by ``align.solve_freed``.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from megatronapp.trace.columns import KINDS, TIMELESS_FIELDS, EventColumns, RankEventsView, TableSource
from megatronapp.trace.metrics import group_ids, nth_in_group

from megatronapp.scan.align.align import MIN_RECV_WAIT_S, AnchorFit, ClockFit, freed_ranks, solve_freed
from megatronapp.scan.align.bounds import all_to_all
from megatronapp.scan.ingest.deps import SyncOp

COLLECTIVE, P2P = 0, 1


def sorted_like_loader(cols: EventColumns) -> EventColumns:
    """Rows by rank, then start, longest first at a tie (stable), like ``load``
    (a table written that way, as runs write theirs, is taken as it is)."""
    d_rank, d_start = np.diff(cols.rank), np.diff(cols.start_s)
    in_order = (d_rank > 0) | ((d_rank == 0) & ((d_start > 0) | (
        (d_start == 0) & (np.diff(cols.dur_s) <= 0))))
    if in_order.all():
        return cols
    return cols.take(np.lexsort((np.arange(len(cols)), -cols.dur_s, cols.start_s, cols.rank)))


COMPUTE_KIND, COLLECTIVE_KIND = KINDS.index("compute"), KINDS.index("collective")


# ------------------------------------------------------------ sync ops
@dataclass(frozen=True)
class SyncTable:
    """Sync ops as arrays: each member row's op, and per op its kind, name and bytes.
    A p2p op's members are its send (``sender``) and its receive (``receiver``)."""

    member_row: np.ndarray  # row of each membership, sorted by op
    member_op: np.ndarray
    op_kind: np.ndarray  # COLLECTIVE | P2P
    op_name: np.ndarray  # name code of the op's first member (its sender for p2p)
    op_bytes: np.ndarray
    op_start: np.ndarray  # first membership of each op in member_row
    sender: np.ndarray  # p2p ops: the send's row (-1 for collectives)
    receiver: np.ndarray

    @property
    def ops(self) -> int:
        return len(self.op_kind)

    def members(self, op: int) -> np.ndarray:
        end = self.op_start[op + 1] if op + 1 < self.ops else len(self.member_row)
        return self.member_row[self.op_start[op]:end]


def _canonical_groups(cols: EventColumns) -> np.ndarray:
    """Group ids made canonical (a group listed in any order is one group)."""
    table: dict[tuple[int, ...], int] = {}
    canon = np.array([table.setdefault(tuple(sorted(g)), len(table)) for g in cols.groups] + [-1],
                     np.int64)
    return canon[cols.group.astype(np.int64)]


def _p2p_sides(cols: EventColumns) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of point-to-point events, their role (0 send, 1 recv) and stream id,
    as ``kinds.p2p_side``: the recorded role and tag, else the role in the name
    and the direction left without it (``send_forward`` -> forward)."""
    role_of: list[int] = []
    direction_of: list[int] = []
    directions: dict[str, int] = {}
    for text in cols.names:
        lowered = text.lower()
        named = next((i for i, w in enumerate(("send", "recv")) if w in lowered), -1)
        direction = lowered.replace(("send", "recv")[named], "", 1).strip("_") if named >= 0 else ""
        role_of.append(named)
        direction_of.append(directions.setdefault(direction, len(directions)))
    name = cols.name.astype(np.int64)
    recorded = cols.role >= 0
    role = np.where(recorded, cols.role, np.array(role_of + [-1], np.int64)[name])
    by_name = np.array(direction_of + [-1], np.int64)[name]
    # one id space: recorded tags (-1 when absent) and name directions apart
    stream, _ = group_ids(recorded.astype(np.int64), np.where(recorded, cols.tag, by_name))
    rows = np.flatnonzero((cols.peer >= 0) & (role >= 0))
    return rows, role[rows], stream[rows]


def sync_table(cols: EventColumns) -> SyncTable:
    """``deps.reconstruct`` over columns: collectives by (group, n-th call on it
    per rank), point-to-point by (sender, receiver, stream) in (iteration,
    microbatch, issue) order."""
    group = _canonical_groups(cols)
    coll = np.flatnonzero((group >= 0) & (cols.kind == COLLECTIVE_KIND))
    seq = nth_in_group(cols.rank[coll].astype(np.int64) * (group.max() + 2) + group[coll])
    c_op, c_count = group_ids(group[coll], seq)
    rows, role, stream = _p2p_sides(cols)
    src = np.where(role == 0, cols.rank[rows], cols.peer[rows]).astype(np.int64)
    dst = np.where(role == 0, cols.peer[rows], cols.rank[rows]).astype(np.int64)
    side, _ = group_ids(role, src, dst, stream)
    nth = nth_in_group(side, [cols.iteration[rows], cols.microbatch[rows]])
    pair, pairs = group_ids(src, dst, stream, nth)
    send_of = np.full(pairs, -1, np.int64)
    recv_of = np.full(pairs, -1, np.int64)
    send_of[pair[role == 0]] = rows[role == 0]
    recv_of[pair[role == 1]] = rows[role == 1]
    matched = (send_of >= 0) & (recv_of >= 0)
    send_of, recv_of = send_of[matched], recv_of[matched]
    # memberships: each collective's members by rank, then each p2p op's send
    # and receive (rows are grouped by rank, so a stable sort by op keeps ranks in order)
    p_ops = np.arange(len(send_of)) + c_count
    order = np.argsort(c_op, kind="stable")
    member_op = np.concatenate([c_op[order], np.repeat(p_ops, 2)])
    member_row = np.concatenate([coll[order], np.stack([send_of, recv_of], axis=1).ravel()])
    n_ops = c_count + len(p_ops)
    op_start = np.searchsorted(member_op, np.arange(n_ops))
    first = member_row[op_start]
    return SyncTable(member_row, member_op,
                     np.r_[np.zeros(c_count, np.int8), np.ones(len(p_ops), np.int8)],
                     cols.name[first], np.maximum(cols.nbytes[first], 0).astype(float),
                     op_start, np.r_[np.full(c_count, -1), send_of],
                     np.r_[np.full(c_count, -1), recv_of])


# ---------------------------------------------------------------- clocks
def _anchors(cols: EventColumns, sync: SyncTable) -> np.ndarray:
    """Ops whose members all finish together: collectives of 2+ ranks, and
    receives that waited for their message."""
    sizes = np.diff(np.r_[sync.op_start, len(sync.member_row)])
    waited = np.zeros(sync.ops, bool)
    p2p = sync.op_kind == P2P
    waited[p2p] = cols.dur_s[sync.receiver[p2p]] >= MIN_RECV_WAIT_S
    return np.where(p2p, waited, sizes > 1)


@dataclass(frozen=True)
class _Memberships:
    """Anchor-op memberships, indexed both ways (rank -> ops, op -> members)."""

    ranks: np.ndarray  # every rank of the trace, ascending
    op: np.ndarray  # per membership, sorted by op
    rank: np.ndarray
    end: np.ndarray
    op_first: np.ndarray  # per op id: first membership (-1: not an anchor)
    op_len: np.ndarray
    by_rank: np.ndarray  # memberships sorted by rank (stable)
    rank_first: np.ndarray  # per rank position
    rank_end: np.ndarray

    def of_rank(self, k: int) -> np.ndarray:
        return self.by_rank[self.rank_first[k]:self.rank_end[k]]

    def of_ops(self, ops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Memberships of ``ops`` and, for each, its op's place in ``ops``."""
        lens = self.op_len[ops]
        rows = np.repeat(self.op_first[ops] - np.r_[0, np.cumsum(lens)[:-1]], lens) + \
            np.arange(int(lens.sum()))
        return rows, np.repeat(np.arange(len(ops)), lens)


def _linked(sync: SyncTable) -> np.ndarray:
    """Ops of 2+ members: they tie their ranks' clocks (the breadth-first order)."""
    return np.diff(np.r_[sync.op_start, len(sync.member_row)]) > 1


def _memberships(cols: EventColumns, sync: SyncTable, ops: np.ndarray) -> _Memberships:
    """Memberships of the ops marked in ``ops``."""
    keep = ops[sync.member_op]
    m_op, m_row = sync.member_op[keep], sync.member_row[keep]
    ranks = np.unique(cols.rank).astype(np.int64)
    m_rank = cols.rank[m_row].astype(np.int64)
    cut = np.r_[0, np.flatnonzero(m_op[1:] != m_op[:-1]) + 1] if len(m_op) else np.zeros(0, int)
    op_first = np.full(sync.ops, -1, np.int64)
    op_len = np.zeros(sync.ops, np.int64)
    op_first[m_op[cut]] = cut
    op_len[m_op[cut]] = np.diff(np.r_[cut, len(m_op)])
    by_rank = np.argsort(m_rank, kind="stable")
    first = np.searchsorted(m_rank[by_rank], ranks)
    return _Memberships(ranks, m_op, m_rank, cols.start_s[m_row] + cols.dur_s[m_row], op_first,
                        op_len, by_rank, first, np.r_[first[1:], len(by_rank)])


def fit_clocks(cols: EventColumns, sync: SyncTable, ref: int | None = None) -> dict[int, ClockFit]:
    """One ClockFit per rank, mapping its local clock onto the reference
    rank's (``ref``, default the lowest rank): ranks in breadth-first order from the
    reference (through every op of 2+ members), each fitted against the already
    fitted members of its anchor ops. Ranks whose fit cannot stand
    (``align.freed_ranks``: completions that do not coincide, no anchors, a
    broken causal bound) are solved as ``align.solve_freed`` does, over
    per-event views of the columns (real traces; simulated ones never get
    there)."""
    m = _memberships(cols, sync, _anchors(cols, sync))
    if not len(m.ranks):
        return {}
    ref = int(m.ranks[0]) if ref is None else ref
    a = np.full(len(m.ranks), np.nan)
    b = np.full(len(m.ranks), np.nan)
    k_ref = int(np.searchsorted(m.ranks, ref))
    a[k_ref], b[k_ref] = 1.0, 0.0
    fits = {ref: ClockFit()}
    anchored: dict[int, AnchorFit] = {}
    for k in _bfs(_memberships(cols, sync, _linked(sync)), k_ref)[1:]:
        mine = m.of_rank(k)
        ops, first = np.unique(m.op[mine], return_index=True)
        xs = m.end[mine[first]]
        ys, ok = _fitted_median(m, ops, a, b)
        rank = int(m.ranks[k])
        anchored[rank] = AnchorFit.through(xs[ok], ys[ok])
        fits[rank] = anchored[rank].fit
        a[k], b[k] = fits[rank].a, fits[rank].b
    violation = causal_violations(cols, sync, m.ranks, a, b)
    free = freed_ranks(anchored, lambda r: float(violation[np.searchsorted(m.ranks, r)]))
    if not free:
        return fits
    return solve_freed(dict(RankEventsView(TableSource(cols))), sync_ops(cols, sync), fits, free)


def causal_violations(cols: EventColumns, sync: SyncTable, ranks: np.ndarray, a: np.ndarray,
                b: np.ndarray) -> np.ndarray:
    """Per rank (position in ``ranks``): by how much its line breaks its worst
    causal bound against the others' lines (``align.causal_bounds``)."""
    worst = np.zeros(len(ranks))
    k = np.searchsorted(ranks, cols.rank).astype(np.int64)

    def to_ref(row: np.ndarray, local: np.ndarray) -> np.ndarray:
        return a[k[row]] * local + b[k[row]]

    end = cols.start_s + cols.dur_s
    p2p = np.flatnonzero(sync.op_kind == P2P)
    send, recv = sync.sender[p2p], sync.receiver[p2p]
    apart = k[send] != k[recv]
    send, recv = send[apart], recv[apart]
    # my send started before the receive ended; my receive ended after the send started
    np.maximum.at(worst, k[send], to_ref(send, cols.start_s[send]) - to_ref(recv, end[recv]))
    np.maximum.at(worst, k[recv], to_ref(send, cols.start_s[send]) - to_ref(recv, end[recv]))
    rows, op = _all_to_all_members(cols, sync)
    if len(rows):
        arrived = _max_of_others(op, to_ref(rows, cols.start_s[rows]))
        left = -_max_of_others(op, -to_ref(rows, end[rows]))
        # I left after the last of them arrived; I arrived before the first left
        np.maximum.at(worst, k[rows], arrived - to_ref(rows, end[rows]))
        np.maximum.at(worst, k[rows], to_ref(rows, cols.start_s[rows]) - left)
    return worst


def _all_to_all_members(cols: EventColumns, sync: SyncTable) -> tuple[np.ndarray, np.ndarray]:
    """Memberships of all-to-all collectives of 2+ members: (row, op)."""
    word = np.array([all_to_all(n) for n in cols.names] + [False])
    ops = (sync.op_kind == COLLECTIVE) & _linked(sync) & word[sync.op_name.astype(np.int64)]
    keep = ops[sync.member_op]
    return sync.member_row[keep], sync.member_op[keep]


def _max_of_others(op: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Per membership (``op`` sorted), the largest ``value`` among the other
    members of its op."""
    order = np.lexsort((-value, op))
    first = np.r_[True, op[order][1:] != op[order][:-1]]
    starts = np.flatnonzero(first)
    top_at = np.repeat(starts, np.diff(np.r_[starts, len(op)]))
    top, second = value[order][top_at], value[order][np.minimum(top_at + 1, len(op) - 1)]
    out = np.empty(len(op))
    out[order] = np.where(np.arange(len(op)) == top_at, second, top)
    return out


def sync_ops(cols: EventColumns, sync: SyncTable) -> list[SyncOp]:
    """The per-event ``SyncOp`` list of the ops of 2+ members (member index
    within its rank, as the per-event view numbers events)."""
    first_row = {r: lo for r, (lo, _hi) in cols.rank_bounds().items()}
    out = []
    for op in np.flatnonzero(_linked(sync)).tolist():
        rows = sync.members(op).tolist()
        members = tuple((int(cols.rank[x]), x - first_row[int(cols.rank[x])]) for x in rows)
        out.append(SyncOp(str(op), "p2p" if sync.op_kind[op] == P2P else "collective",
                          cols.names[int(sync.op_name[op])], members, float(sync.op_bytes[op])))
    return out


def _fitted_median(m: _Memberships, ops: np.ndarray, a: np.ndarray,
                   b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per op, the median of its fitted members' end times on the reference clock."""
    rows, which = m.of_ops(ops)
    k = np.searchsorted(m.ranks, m.rank[rows])
    fitted = ~np.isnan(a[k])
    mapped = a[k][fitted] * m.end[rows][fitted] + b[k][fitted]
    which = which[fitted]
    order = np.lexsort((mapped, which))
    mapped, which = mapped[order], which[order]
    count = np.bincount(which, minlength=len(ops))
    ok = count > 0
    if not ok.any():
        return np.zeros(len(ops)), ok
    first = np.r_[0, np.cumsum(count)[:-1]]
    lo = mapped[np.minimum(first + (count - 1) // 2, len(mapped) - 1)]
    hi = mapped[np.minimum(first + count // 2, len(mapped) - 1)]
    return (lo + hi) / 2, ok


def _bfs(m: _Memberships, k_ref: int) -> list[int]:
    """Breadth-first order of rank positions from ``k_ref``: each rank's unseen co-members in
    ascending order; an op once expanded has no unseen member left."""
    seen = np.zeros(len(m.ranks), bool)
    expanded = np.zeros(len(m.op_first), bool)
    seen[k_ref] = True
    order, queue = [k_ref], deque([k_ref])
    while queue:
        ops = np.unique(m.op[m.of_rank(queue.popleft())])
        ops = ops[~expanded[ops]]
        expanded[ops] = True
        rows, _ = m.of_ops(ops)
        new = np.searchsorted(m.ranks, np.unique(m.rank[rows]))
        new = new[~seen[new]]
        seen[new] = True
        order += new.tolist()
        queue.extend(new.tolist())
    return order + np.flatnonzero(~seen).tolist()


def apply_clocks(cols: EventColumns, fits: dict[int, ClockFit]) -> EventColumns:
    ranks = np.unique(cols.rank)
    a = np.array([fits.get(int(r), ClockFit()).a for r in ranks])
    b = np.array([fits.get(int(r), ClockFit()).b for r in ranks])
    k = np.searchsorted(ranks, cols.rank)
    fields = {f: getattr(cols, f) for f in TIMELESS_FIELDS}
    return EventColumns(**fields, start_s=a[k] * cols.start_s + b[k], dur_s=a[k] * cols.dur_s,
                        names=cols.names, groups=cols.groups, extra=cols.extra)
