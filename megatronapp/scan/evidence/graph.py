"""Everything about a batch's dependency graph lives here: which op each op
waits for, as arrays, so that the batch can be replayed (``replay``).

Nodes are a batch's ops: its compute, point-to-point and collective rows
(annotations are not ops). An op

- starts its ``gap`` after its rank's ``pred``: the op of its rank that ended
  last before it started (program order; the gap is host time, in which the
  rank ran no op). A rank's first op in the batch starts its gap after its
  iteration's range began (``ProfilerStep#N``), or when it was recorded;
- if it is a member of a sync op, ends its ``residual`` after it and the
  partners it waited for have all started (a collective's other members, a
  transfer's other side; ``waits``): the residual is the time that passed
  once everyone was there, its own transfer time. A member that ended before
  a partner started waited for nobody; it ends its duration after it starts;
- otherwise ends its duration after it starts.

Replayed with the recorded durations, the graph gives back the recorded
times (``replay``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatronapp.trace.columns import KINDS, EventColumns

from megatronapp.scan.align.table import COLLECTIVE, SyncTable

COMPUTE, SYNC, FREE = 0, 1, 2  # how an op's end is found (FREE: unmatched communication)
_COMPUTE_KIND, _OTHER_KIND = KINDS.index("compute"), KINDS.index("other")
TOLERANCE_S = 1e-7  # times are written in µs with 3 decimals; clock fits add rounding


@dataclass(frozen=True)
class Graph:
    """A batch's ops and what each waits for (see the module docstring)."""

    row: np.ndarray  # each op's row in the batch's columns
    rank: np.ndarray
    iteration: np.ndarray  # dense index into ``iterations``
    iterations: np.ndarray  # the iteration numbers (-1: events without one)
    how: np.ndarray  # COMPUTE | SYNC | FREE
    start: np.ndarray
    end: np.ndarray
    pred: np.ndarray  # -1: the rank's first op of the batch
    gap: np.ndarray  # host seconds between pred's end (or the anchor) and the start (a rounding overlap: < 0)
    anchor: np.ndarray  # where a first op's gap counts from (its start elsewhere)
    residual: np.ndarray  # seconds from everyone-there to the end (duration if none waited)
    waits_ptr: np.ndarray  # CSR: op i waits for the starts of waits[waits_ptr[i]:waits_ptr[i+1]]
    waits: np.ndarray
    blocking: np.ndarray  # its end counts toward its iteration's end
    link: np.ndarray  # transfer ops: the id of their (unordered) rank pair, else -1
    links: np.ndarray  # per link id: (low rank, high rank)
    flow: np.ndarray  # transfer ops: the id of their channel (pair and direction), else -1
    flows: tuple[tuple[int, int, str], ...]  # per flow id: (sender, receiver, direction)

    def __len__(self) -> int:
        return len(self.row)

    @property
    def dur(self) -> np.ndarray:
        return self.end - self.start


def graph_of(cols: EventColumns, sync: SyncTable) -> Graph:
    """The dependency graph of one batch of whole iterations."""
    stepped = cols.iteration >= 0
    # ops outside every iteration (set-up before the first step) when the trace has steps
    ops = np.flatnonzero((cols.kind != _OTHER_KIND) & (stepped | ~stepped.any()))
    rank = cols.rank[ops].astype(np.int64)
    start, end = cols.start_s[ops], cols.start_s[ops] + cols.dur_s[ops]
    iterations, iteration = np.unique(cols.iteration[ops], return_inverse=True)
    node_of_row = np.full(len(cols) + 1, -1, np.int64)
    node_of_row[ops] = np.arange(len(ops))
    pred = _program_order(rank, start, end)
    anchor = np.where(pred >= 0, 0.0, _range_starts(cols, ops, iteration, iterations))
    prev_end = np.where(pred >= 0, end[np.maximum(pred, 0)], anchor)
    gap = np.maximum(start - prev_end, -TOLERANCE_S)  # a rounding overlap replays exactly
    how = np.where(cols.kind[ops] == _COMPUTE_KIND, COMPUTE, FREE).astype(np.int8)
    waits_ptr, waits, residual = _sync_waits(sync, node_of_row, start, end, how)
    link, links, flow, flows = _links(cols, sync, node_of_row, len(ops))
    blocking = _blocking(pred, how, sync, node_of_row, len(ops))
    return Graph(ops, rank, iteration.astype(np.int64), iterations, how, start, end, pred, gap,
                 anchor, residual, waits_ptr, waits, blocking, link, links, flow, flows)


def _program_order(rank: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Each op's pred: the op of its rank that ended last at or before its start,
    among the ops that end before it (by end, then start, then index: a strict
    order, so ops shorter than the tolerance cannot be each other's pred)."""
    pred = np.full(len(rank), -1, np.int64)
    by_end = np.lexsort((np.arange(len(rank)), start, end, rank))
    place = np.empty(len(rank), np.int64)
    place[by_end] = np.arange(len(rank))
    rank_of_sorted, end_sorted = rank[by_end], end[by_end]
    cuts = np.r_[0, np.flatnonzero(np.diff(rank_of_sorted)) + 1, len(by_end)]
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        mine = by_end[lo:hi]
        k = np.searchsorted(end_sorted[lo:hi], start[mine] + TOLERANCE_S, side="right")
        k = np.minimum(k, place[mine] - lo)  # only ops before it in that order
        pred[mine] = np.where(k > 0, mine[np.maximum(k - 1, 0)], -1)
    return pred


def _range_starts(cols: EventColumns, ops: np.ndarray, iteration: np.ndarray,
                  iterations: np.ndarray) -> np.ndarray:
    """Per op, the start of its rank's range of its iteration (``ProfilerStep#N``-like
    annotations: the earliest 'other' row of that rank and iteration), else its own start."""
    out = cols.start_s[ops].copy()
    other = np.flatnonzero((cols.kind == _OTHER_KIND) & (cols.iteration >= 0))
    if not len(other):
        return out
    key_of = {(int(r), int(i)): s for r, i, s in sorted(
        zip(cols.rank[other], cols.iteration[other], cols.start_s[other]), key=lambda t: -t[2])}
    for n, (r, i) in enumerate(zip(cols.rank[ops].tolist(), iterations[iteration].tolist())):
        s = key_of.get((r, i))
        if s is not None and s <= out[n]:
            out[n] = s
    return out


def _sync_waits(sync: SyncTable, node_of_row: np.ndarray, start: np.ndarray, end: np.ndarray,
                how: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR of the partners each sync member waited for, and its residual."""
    n = len(start)
    residual = end - start
    member = node_of_row[sync.member_row]
    op = sync.member_op
    sizes = np.diff(np.r_[sync.op_start, len(sync.member_row)])
    keep = (member >= 0) & (sizes[op] >= 2)
    member, op = member[keep], op[keep]
    how[member] = SYNC
    # each member waits for every other member's start (a transfer: its other side)
    first = np.searchsorted(op, op, side="left")
    last = np.searchsorted(op, op, side="right")
    counts = last - first - 1
    src = np.repeat(np.arange(len(member)), counts)
    offsets = np.arange(len(src)) - np.repeat(np.cumsum(counts) - counts, counts)
    other = first[src] + offsets
    other = other + (other >= np.arange(len(member))[src])  # skip the member itself
    a, b = member[src], member[other]
    waited = start[b] <= end[a] + TOLERANCE_S  # a partner that came later was not waited for
    a, b = a[waited], b[waited]
    ready = start.copy()
    np.maximum.at(ready, a, start[b])
    has = np.zeros(n, bool)
    has[a] = True
    residual[has] = np.maximum(end[has] - np.maximum(start[has], ready[has]), 0.0)
    order = np.argsort(a, kind="stable")
    a, b = a[order], b[order]
    ptr = np.searchsorted(a, np.arange(n + 1))
    return ptr.astype(np.int64), b.astype(np.int64), residual


def _links(cols: EventColumns, sync: SyncTable, node_of_row: np.ndarray, n: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[tuple[int, int, str], ...]]:
    """Transfer ops' links (unordered rank pairs) and flows (sender, receiver,
    direction as named: forward/backward, else up/down the ranks)."""
    link = np.full(n, -1, np.int64)
    flow = np.full(n, -1, np.int64)
    p2p = np.flatnonzero((sync.op_kind != COLLECTIVE) & (sync.sender >= 0))
    send, recv = sync.sender[p2p], sync.receiver[p2p]
    s, r = cols.rank[send].astype(np.int64), cols.rank[recv].astype(np.int64)
    apart = s != r
    send, recv, s, r = send[apart], recv[apart], s[apart], r[apart]
    lo, hi = np.minimum(s, r), np.maximum(s, r)
    pairs, pair_id = np.unique(np.stack([lo, hi], axis=1).reshape(-1, 2), axis=0,
                               return_inverse=True)
    pair_id = pair_id.reshape(-1)
    direction = np.array([_direction(cols.names[int(c)], a, b)
                          for c, a, b in zip(cols.name[send], s, r)], dtype=object)
    keys = sorted({(int(a), int(b), str(d)) for a, b, d in zip(s, r, direction)})
    flow_id = {k: i for i, k in enumerate(keys)}
    ids = np.array([flow_id[(int(a), int(b), str(d))] for a, b, d in zip(s, r, direction)],
                   np.int64)
    for rows in (send, recv):
        nodes = node_of_row[rows]
        ok = nodes >= 0
        link[nodes[ok]] = pair_id[ok]
        flow[nodes[ok]] = ids[ok]
    return link, pairs.astype(np.int64).reshape(-1, 2), flow, tuple(keys)


def _direction(name: str, sender: int, receiver: int) -> str:
    lowered = name.lower()
    for word in ("forward", "backward"):
        if word in lowered:
            return word
    return "up" if sender < receiver else "down"


def _blocking(pred: np.ndarray, how: np.ndarray, sync: SyncTable,
              node_of_row: np.ndarray, n: int) -> np.ndarray:
    """Ops whose end an iteration waits for: every op some op follows, every
    compute and collective, every receive; not a send nothing followed (its
    completion came in the background)."""
    blocking = how != FREE
    blocking[pred[pred >= 0]] = True
    sends = node_of_row[sync.sender[sync.sender >= 0]]
    sends = sends[sends >= 0]
    followed = np.zeros(n, bool)
    followed[pred[pred >= 0]] = True
    blocking[sends] = followed[sends]
    return blocking
