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
from functools import cached_property

import numpy as np
from numba import njit

from megatronapp.trace.columns import KINDS, EventColumns
from megatronapp.trace.metrics import distinct_ints

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

    @cached_property
    def dur(self) -> np.ndarray:
        """Each op's seconds (worked out once: every suspect's table reads it)."""
        return self.end - self.start


def graph_of(cols: EventColumns, sync: SyncTable) -> Graph:
    """The dependency graph of one batch of whole iterations."""
    stepped = cols.iteration >= 0
    # ops outside every iteration (set-up before the first step) when the trace has steps
    ops = np.flatnonzero((cols.kind != _OTHER_KIND) & (stepped | ~stepped.any()))
    rank = cols.rank[ops].astype(np.int64)
    start, end = cols.start_s[ops], cols.start_s[ops] + cols.dur_s[ops]
    iterations, iteration = distinct_ints(cols.iteration[ops])
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
    by_end = np.lexsort((start, end, rank))  # stable: of equal keys, by index
    rank_of_sorted = rank[by_end]
    cuts = np.r_[0, np.flatnonzero(np.diff(rank_of_sorted)) + 1, len(by_end)]
    return _preds(by_end, cuts, start, end[by_end])


@njit(cache=True)
def _preds(by_end: np.ndarray, cuts: np.ndarray, start: np.ndarray,
           end_sorted: np.ndarray) -> np.ndarray:
    """Per rank (``by_end[cuts[r]:cuts[r + 1]]``, its ops by end), each op's
    pred: the last op before it in that order that ends by its start."""
    pred = np.full(len(by_end), -1, np.int64)
    for r in range(len(cuts) - 1):
        lo, hi = cuts[r], cuts[r + 1]
        for p in range(lo, hi):
            mine = by_end[p]
            at = start[mine] + TOLERANCE_S
            a, b = lo, hi  # the first of the rank's ends after ``at``
            while a < b:
                m = (a + b) // 2
                if end_sorted[m] <= at:
                    a = m + 1
                else:
                    b = m
            k = min(a, p)  # only ops before it in that order
            if k > lo:
                pred[mine] = by_end[k - 1]
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
    member = node_of_row[sync.member_row]
    op = sync.member_op
    sizes = np.diff(np.r_[sync.op_start, len(sync.member_row)])
    keep = (member >= 0) & (sizes[op] >= 2)
    member, op = member[keep], op[keep]
    how[member] = SYNC
    return _waited_partners(member, np.r_[0, np.flatnonzero(np.diff(op)) + 1, len(op)],
                            start, end)


@njit(cache=True)
def _waited_partners(member: np.ndarray, bounds: np.ndarray, start: np.ndarray,
                     end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each member (``member[bounds[k]:bounds[k + 1]]`` are op k's) waits for
    every other member's start (a transfer: its other side) that came before
    its own end: a partner that came later was not waited for. The partners
    of a node are listed in the order of the member list."""
    n = len(start)
    ptr = np.zeros(n + 1, np.int64)
    for k in range(len(bounds) - 1):
        for p in range(bounds[k], bounds[k + 1]):
            for q in range(bounds[k], bounds[k + 1]):
                if q != p and start[member[q]] <= end[member[p]] + TOLERANCE_S:
                    ptr[member[p] + 1] += 1
    ptr = np.cumsum(ptr)
    fill = ptr[:-1].copy()
    waits = np.empty(ptr[-1], np.int64)
    ready = start.copy()
    for k in range(len(bounds) - 1):
        for p in range(bounds[k], bounds[k + 1]):
            a = member[p]
            for q in range(bounds[k], bounds[k + 1]):
                b = member[q]
                if q != p and start[b] <= end[a] + TOLERANCE_S:
                    waits[fill[a]] = b
                    fill[a] += 1
                    ready[a] = max(ready[a], start[b])
    residual = end - start
    waited = ptr[1:] > ptr[:-1]
    residual[waited] = np.maximum(end[waited] - ready[waited], 0.0)
    return ptr, waits, residual


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
    width = int(max(s.max(initial=0), r.max(initial=0))) + 1
    codes, pair_id = np.unique(np.minimum(s, r) * width + np.maximum(s, r),
                               return_inverse=True)
    pairs = np.stack([codes // width, codes % width], axis=1)
    pair_id = pair_id.reshape(-1)
    direction = _directions(cols, send, s, r)
    codes, ids = np.unique((s * width + r) * len(DIRECTIONS) + direction, return_inverse=True)
    keys = [(int(c // len(DIRECTIONS) // width), int(c // len(DIRECTIONS) % width),
             DIRECTIONS[int(c % len(DIRECTIONS))]) for c in codes.tolist()]
    ids = ids.reshape(-1).astype(np.int64)
    for rows in (send, recv):
        nodes = node_of_row[rows]
        ok = nodes >= 0
        link[nodes[ok]] = pair_id[ok]
        flow[nodes[ok]] = ids[ok]
    return link, pairs.astype(np.int64).reshape(-1, 2), flow, tuple(keys)


DIRECTIONS = ("backward", "down", "forward", "up")  # in sorted order: flows sort as named


def _directions(cols: EventColumns, send: np.ndarray, sender: np.ndarray,
                receiver: np.ndarray) -> np.ndarray:
    """Each transfer's direction (an index into DIRECTIONS): forward or
    backward where its name says so, else up or down the ranks."""
    word = np.full(len(cols.names) + 1, -1, np.int64)
    for code, name in enumerate(cols.names):
        lowered = name.lower()
        word[code] = (DIRECTIONS.index("forward") if "forward" in lowered else
                      DIRECTIONS.index("backward") if "backward" in lowered else -1)
    named = word[cols.name[send]]
    by_rank = np.where(sender < receiver, DIRECTIONS.index("up"), DIRECTIONS.index("down"))
    return np.where(named >= 0, named, by_rank)


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
