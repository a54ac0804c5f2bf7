"""Run metrics over event columns, vectorised.

Every function takes ``EventColumns`` and a ``weight`` per row: how many ranks
that row stands for (1 for a plain table; a class's size for the compact form
of a symmetric run, where one simulated pipeline stands for many identical
ones). Means over ranks, messages or windows are weighted accordingly, so a
compact run and its full expansion give the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa

from .columns import KINDS, EventColumns
from .exact import exact_sum

COMPUTE = KINDS.index("compute")


def distinct_ints(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` for integers, by a presence
    table where their range is small (a sort of millions of ranks, names or
    iterations per batch is most of what the table saves)."""
    values = np.asarray(values)
    integers = len(values) > 0 and values.dtype.kind in "iu"
    lo, hi = (int(values.min()), int(values.max())) if integers else (0, 0)
    if not integers or hi - lo + 1 > max(2 * len(values), 1 << 20):
        distinct, inverse = np.unique(values, return_inverse=True)
        return distinct, inverse.reshape(-1).astype(np.int64, copy=False)
    offset = values.astype(np.int64) - lo
    present = np.zeros(hi - lo + 1, bool)
    present[offset] = True
    dense = np.cumsum(present, dtype=np.int64) - 1
    return (np.flatnonzero(present) + lo).astype(values.dtype), dense[offset]


def sums_at(shape: tuple[int, int], rows: np.ndarray, cols: np.ndarray,
            values: np.ndarray | None = None) -> np.ndarray:
    """``np.add.at(zeros(shape), (rows, cols), values)`` (counts where
    ``values`` is None) by one bincount: the same sums, added in the same
    order, without ``add.at``'s per-element dispatch."""
    flat = np.asarray(rows, np.int64) * shape[1] + np.asarray(cols, np.int64)
    return np.bincount(flat, values, minlength=shape[0] * shape[1]).reshape(shape)


def group_ids(*keys: np.ndarray) -> tuple[np.ndarray, int]:
    """A dense id per distinct tuple of ``keys`` (row-aligned integer arrays),
    ids in the tuples' sorted order."""
    if not len(keys[0]):
        return np.zeros(0, np.int64), 0
    radix = _radix_key(keys)
    if radix is None:
        return _group_ids_rows(keys)
    return _dense_ids(*radix)


def _radix_key(keys: Sequence[np.ndarray]) -> tuple[np.ndarray, int] | None:
    """One int64 per tuple of ``keys`` (mixed radix), ordered as the tuples are,
    and its range; None when the ranges do not fit one integer."""
    combined = np.zeros(len(keys[0]), np.int64)
    span = 1
    for k in keys:
        k = np.asarray(k)
        lo, hi = int(k.min()), int(k.max())
        width = hi - lo + 1
        if span * width >= 1 << 62:
            return None
        # in place: each temporary of a 47 M-row key costs its pages again
        combined *= width
        combined += k
        combined -= lo
        span *= width
    return combined, span


def _dense_ids(combined: np.ndarray, span: int) -> tuple[np.ndarray, int]:
    """``np.unique(combined, return_inverse=True)``'s ids, faster: a scan for
    keys already in order, a presence table over a small range, sorting when
    most keys are distinct, else hashing (pyarrow) and sorting only the
    distinct keys. Millions of rows per call."""
    n = len(combined)
    if n < 2 or bool((combined[1:] >= combined[:-1]).all()):
        ids = np.zeros(n, np.int64)
        np.cumsum(combined[1:] != combined[:-1], out=ids[1:])
        return ids, int(ids[-1]) + 1
    if span <= max(2 * n, 1 << 20):
        present = np.zeros(span, bool)
        present[combined] = True
        dense = np.cumsum(present, dtype=np.int32)
        dense -= 1
        return dense[combined].astype(np.int64), int(dense[-1]) + 1
    if _mostly_distinct(combined):  # a hash table as large as the rows is slower than a sort
        distinct, ids = np.unique(combined, return_inverse=True)
        return ids.reshape(-1).astype(np.int64, copy=False), len(distinct)
    encoded = pa.array(combined).dictionary_encode()
    distinct = encoded.dictionary.to_numpy()
    rank = np.empty(len(distinct), np.int64)
    rank[np.argsort(distinct)] = np.arange(len(distinct))
    return rank[encoded.indices.to_numpy()], len(distinct)


def _mostly_distinct(values: np.ndarray, sample: int = 1 << 12) -> bool:
    """Whether an evenly spread sample of ``values`` is more than half distinct
    (a few thousand decide it: a sample as large as the keys sorted them all
    only to choose how to sort them)."""
    picked = values[::max(1, len(values) // sample)]
    return 2 * len(np.unique(picked)) > len(picked)


def _group_ids_rows(keys: tuple[np.ndarray, ...]) -> tuple[np.ndarray, int]:
    stacked = np.stack([np.asarray(k, np.int64) for k in keys], axis=1)
    _, ids = np.unique(stacked, axis=0, return_inverse=True)
    ids = ids.reshape(-1)
    return ids, int(ids.max()) + 1


def unit_weights(cols: EventColumns) -> np.ndarray:
    return np.ones(len(cols))


def weighted_mean(values: np.ndarray, weight: np.ndarray) -> float:
    """The mean of ``values`` weighted by ``weight``, its sums exact (``exact``):
    the same bits whichever batches the values came in."""
    total = exact_sum(weight)
    return exact_sum(values * weight) / total if total > 0 else 0.0


# ------------------------------------------------------------- iterations
def iteration_spans(cols: EventColumns) -> dict[int, tuple[float, float]]:
    """iteration -> (first start, last end) over all ranks."""
    has = cols.iteration >= 0
    its, start, end = cols.iteration[has], cols.start_s[has], cols.end_s[has]
    out = {}
    for it in distinct_ints(its)[0]:  # a job's few iterations: a pass each
        mine = its == it
        out[int(it)] = (float(start[mine].min()), float(end[mine].max()))
    return out


def busy_times(cols: EventColumns, weight: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Compute busy time per (rank, iteration) of the ranks in ``cols``: the
    ranks (ascending), each rank's weight, the iterations with compute and a
    (ranks, iterations) matrix of summed durations (each rank's rows in their
    order, so a rank's sums do not depend on the rows of others)."""
    ranks, rank_of_row = distinct_ints(cols.rank)
    rank_weight = np.zeros(len(ranks))
    rank_weight[rank_of_row] = weight
    counted = (cols.kind == COMPUTE) & (cols.iteration >= 0)
    its, it_index = distinct_ints(cols.iteration[counted])
    busy = np.bincount(rank_of_row[counted] * len(its) + it_index.reshape(-1),
                       weights=cols.dur_s[counted], minlength=len(ranks) * len(its))
    return ranks, rank_weight, its, busy.reshape(len(ranks), len(its))


# ------------------------------------------------------------------ memory
def live_slot_peaks(cols: EventColumns) -> dict[int, int]:
    """rank -> most activations stored at once: a forward takes a slot at its
    start, its backward frees it at its end (at equal times, to 10 ns, a
    release counts first)."""
    fwd, bwd = cols.name_code("forward"), cols.name_code("backward")
    f, b = cols.name == fwd, cols.name == bwd
    rank = np.concatenate([cols.rank[f], cols.rank[b]]).astype(np.int64)
    when = np.round(np.concatenate([cols.start_s[f], cols.end_s[b]]), 8)
    delta = np.concatenate([np.ones(int(f.sum()), np.int64), -np.ones(int(b.sum()), np.int64)])
    if not len(rank):
        return {int(r): 0 for r in np.unique(cols.rank)}
    order = np.lexsort((delta, when, rank))
    rank, delta = rank[order], delta[order]
    running = np.cumsum(delta)
    first = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]])
    base = np.repeat(running[first] - delta[first], np.diff(np.r_[first, len(rank)]))
    live = running - base
    peaks = {int(r): 0 for r in np.unique(cols.rank)}
    peaks.update({int(r): int(m) for r, m in zip(rank[first], np.maximum.reduceat(live, first))})
    return peaks


# ----------------------------------------------------------------- windows
@dataclass(frozen=True)
class SendWindows:
    """One row per message matched to the task that consumes it."""

    src: np.ndarray
    dst: np.ndarray
    phase: np.ndarray  # 0 forward, 1 backward
    iteration: np.ndarray
    microbatch: np.ndarray
    nbytes: np.ndarray
    window_s: np.ndarray  # send posted -> consumer starts
    transfer_s: np.ndarray
    weight: np.ndarray


PHASES = ("forward", "backward")


def _phase_rows(cols: EventColumns, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """Rows named ``{prefix}_forward`` / ``{prefix}_backward`` with task args, and their phase."""
    phase = np.full(len(cols), -1, np.int64)
    for i, p in enumerate(PHASES):
        code = cols.name_code(f"{prefix}_{p}")
        if code >= 0:
            phase[cols.name == code] = i
    ok = (phase >= 0) & (cols.peer >= 0) & (cols.iteration >= 0) & (cols.microbatch >= 0) & (
        cols.chunk >= 0)
    return np.flatnonzero(ok), phase


def nth_in_group(ids: np.ndarray, order_by: Sequence[np.ndarray] = ()) -> np.ndarray:
    """Per row, its place (0, 1, ...) among the rows with its id, ordered by
    ``order_by`` then row order (a stable sort)."""
    if not len(ids):
        return np.zeros(0, np.int64)
    key = ids
    if len(order_by):  # the mixed-radix key sorts as the dense ids do, without building them
        radix = _radix_key([ids, *order_by])
        key = group_ids(ids, *order_by)[0] if radix is None else radix[0]
    order = np.argsort(key, kind="stable")
    sorted_ids = ids[order]
    first = np.r_[0, np.flatnonzero(sorted_ids[1:] != sorted_ids[:-1]) + 1]
    nth_sorted = np.arange(len(ids)) - np.repeat(first, np.diff(np.r_[first, len(ids)]))
    nth = np.empty(len(ids), np.int64)
    nth[order] = nth_sorted
    return nth


def send_windows(cols: EventColumns, weight: np.ndarray) -> SendWindows:
    """Match each send to its receive (per src, dst, phase, iteration and
    microbatch, both sides in chunk order) and the receiver's task that needs
    it (the forward or backward of that microbatch and the receive's chunk)."""
    s, phase = _phase_rows(cols, "send")
    r, r_phase = _phase_rows(cols, "recv")
    s_key = [cols.rank[s], cols.peer[s], phase[s], cols.iteration[s], cols.microbatch[s]]
    r_key = [cols.peer[r], cols.rank[r], r_phase[r], cols.iteration[r], cols.microbatch[r]]
    s_nth = nth_in_group(group_ids(*s_key)[0], [cols.chunk[s]])
    r_nth = nth_in_group(group_ids(*r_key)[0], [cols.chunk[r]])
    ids, _ = group_ids(*[np.concatenate([a, b]) for a, b in zip(s_key + [s_nth], r_key + [r_nth])])
    s_id, r_id = ids[:len(s)], ids[len(s):]
    r_of_id = np.full(int(ids.max()) + 1 if len(ids) else 0, -1, np.int64)
    r_of_id[r_id] = r
    recv = r_of_id[s_id] if len(s) else np.zeros(0, np.int64)
    matched = recv >= 0
    s, recv = s[matched], recv[matched]
    needed = _task_start(cols, cols.rank[recv], phase[s], cols.iteration[recv],
                         cols.microbatch[recv], cols.chunk[recv])
    found = ~np.isnan(needed)
    s, needed = s[found], needed[found]
    return SendWindows(cols.rank[s], cols.peer[s], phase[s], cols.iteration[s],
                       cols.microbatch[s], cols.nbytes[s], needed - cols.start_s[s],
                       cols.dur_s[s], weight[s])


def _task_start(cols: EventColumns, rank: np.ndarray, phase: np.ndarray, it: np.ndarray,
                mb: np.ndarray, chunk: np.ndarray) -> np.ndarray:
    """Start of each asked-for forward/backward task (NaN where there is none)."""
    codes = [cols.name_code(p) for p in PHASES]
    task_phase = np.full(len(cols), -1, np.int64)
    for i, code in enumerate(codes):
        if code >= 0:
            task_phase[cols.name == code] = i
    t = np.flatnonzero((task_phase >= 0) & (cols.microbatch >= 0) & (cols.chunk >= 0))
    if not len(rank) or not len(t):
        return np.full(len(rank), np.nan)
    keys = [np.concatenate([a, b]) for a, b in zip(
        [cols.rank[t], task_phase[t], cols.iteration[t], cols.microbatch[t], cols.chunk[t]],
        [rank, phase, it, mb, chunk])]
    ids, n = group_ids(*keys)
    start_of = np.full(n, np.nan)
    start_of[ids[:len(t)]] = cols.start_s[t]  # a repeated task keeps its last start
    return start_of[ids[len(t):]]


def allreduce_windows(cols: EventColumns, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, iteration and chunk: its last backward's end -> the optimizer
    step's start (the time that chunk's gradient sync can overlap), and weights."""
    bwd, opt = cols.name_code("backward"), cols.name_code("optimizer")
    b = np.flatnonzero(cols.name == bwd) if bwd >= 0 else np.zeros(0, np.int64)
    o = np.flatnonzero(cols.name == opt) if opt >= 0 else np.zeros(0, np.int64)
    if not len(b) or not len(o):
        return np.zeros(0), np.zeros(0)
    chunk = np.where(cols.chunk[b] >= 0, cols.chunk[b], 0)
    ids, n = group_ids(cols.rank[b], cols.iteration[b], chunk)
    last_end = np.full(n, -np.inf)
    np.maximum.at(last_end, ids, cols.end_s[b])
    first = np.unique(ids, return_index=True)[1]
    rows = b[first]
    keys = [np.concatenate([a, c]) for a, c in zip([cols.rank[o], cols.iteration[o]],
                                                   [cols.rank[rows], cols.iteration[rows]])]
    kid, m = group_ids(*keys)
    opt_start = np.full(m, np.nan)
    opt_start[kid[:len(o)]] = cols.start_s[o]  # the last optimizer of an iteration
    window = opt_start[kid[len(o):]] - last_end[ids[first]]
    ok = ~np.isnan(window)
    return window[ok], weight[rows][ok]
