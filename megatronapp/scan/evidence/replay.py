"""Everything about replaying a batch's dependency graph lives here: how each
of its iterations would have ended had some suspects taken their expected
time (a what-if), and the order that makes one pass enough.

Each op is two nodes, its start (``2i``) and its end (``2i + 1``). A start
waits for its pred's end; an end waits for its own start and, for a sync
member, for the starts of the partners it waited for (``graph``). One pass
in dependency order computes every node (compiled: a 12,288-GPU iteration
holds tens of millions of ops).

A scenario fixes some suspects: a fixed suspect's ops take ``ratio`` x
their recorded part (a rank's compute durations, a rank's host gaps, a
link's residual transfer times); the others keep theirs. With nothing fixed
the replay gives back the recorded times.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from megatronapp.trace.metrics import distinct_ints

from .graph import COMPUTE, SYNC, Graph


@njit(cache=True)
def _children(n: int, pred: np.ndarray, waits_ptr: np.ndarray, waits: np.ndarray,
              use_waits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR of each node's dependants, and each node's count of dependencies
    (nodes as int32: half the memory; a batch holds far fewer than 2**30 ops)."""
    count = np.zeros(2 * n + 1, np.int32)
    indegree = np.zeros(2 * n, np.int32)
    for i in range(n):
        if pred[i] >= 0:
            count[2 * pred[i] + 1] += 1
            indegree[2 * i] += 1
        count[2 * i] += 1
        indegree[2 * i + 1] += 1
        if use_waits[i]:
            for k in range(waits_ptr[i], waits_ptr[i + 1]):
                count[2 * waits[k]] += 1
                indegree[2 * i + 1] += 1
    ptr = np.zeros(2 * n + 1, np.int64)
    for v in range(2 * n):
        ptr[v + 1] = ptr[v] + count[v]
    fill = ptr[:-1].copy()
    child = np.empty(ptr[-1], np.int32)
    for i in range(n):
        if pred[i] >= 0:
            child[fill[2 * pred[i] + 1]] = 2 * i
            fill[2 * pred[i] + 1] += 1
        child[fill[2 * i]] = 2 * i + 1
        fill[2 * i] += 1
        if use_waits[i]:
            for k in range(waits_ptr[i], waits_ptr[i + 1]):
                child[fill[2 * waits[k]]] = 2 * i + 1
                fill[2 * waits[k]] += 1
    return ptr, child, indegree


@njit(cache=True)
def _kahn(ptr: np.ndarray, child: np.ndarray, indegree: np.ndarray) -> np.ndarray:
    """A topological order of the nodes (shorter than all of them if a cycle remains)."""
    nodes = len(indegree)
    order = np.empty(nodes, np.int32)
    head = tail = 0
    left = indegree.copy()
    for v in range(nodes):
        if left[v] == 0:
            order[tail] = v
            tail += 1
    while head < tail:
        v = order[head]
        head += 1
        for k in range(ptr[v], ptr[v + 1]):
            c = child[k]
            left[c] -= 1
            if left[c] == 0:
                order[tail] = c
                tail += 1
    return order[:tail]


def dependency_order(g: Graph) -> tuple[np.ndarray, np.ndarray]:
    """The nodes in dependency order, and which ops keep their waits: where
    misaligned clocks left a cycle, the members on it are taken to have
    waited for nobody (their residual becomes their duration)."""
    n = len(g)
    use_waits = np.ones(n, np.bool_)
    while True:
        ptr, child, indegree = _children(n, g.pred, g.waits_ptr, g.waits, use_waits)
        order = _kahn(ptr, child, indegree)
        if len(order) == 2 * n:
            return order, use_waits
        placed = np.zeros(2 * n, bool)
        placed[order] = True
        stuck = np.flatnonzero(~placed[1::2] & use_waits & (np.diff(g.waits_ptr) > 0))
        if not len(stuck):
            raise ValueError("the trace's program order has a cycle")  # never: preds end first
        use_waits[stuck] = False


@dataclass(frozen=True)
class Suspects:
    """Which suspect each rank's compute, each rank's host time and each link
    is (-1: none), and what fixing a suspect makes of its part per iteration
    (``ratio``: suspects x iterations)."""

    compute: np.ndarray  # per rank
    host: np.ndarray  # per rank
    link: np.ndarray  # per link id
    ratio: np.ndarray

    @classmethod
    def none(cls, g: Graph) -> "Suspects":
        ranks = int(g.rank.max(initial=-1)) + 1
        return cls(np.full(ranks, -1, np.int64), np.full(ranks, -1, np.int64),
                   np.full(len(g.links), -1, np.int64), np.ones((0, len(g.iterations))))


@njit(cache=True)
def _replay(order: np.ndarray, ops: tuple, s: np.ndarray, e: np.ndarray, n_iter: int,
            compute: np.ndarray, host: np.ndarray, link_suspect: np.ndarray, ratio: np.ndarray,
            fixed: np.ndarray) -> np.ndarray:
    """Each iteration's end under one scenario: a suspect that ``fixed``
    marks has its ops' part times its ``ratio`` in their iteration. Each
    op's start and end are written to ``s`` and ``e`` before they are read."""
    (how, pred, gap, anchor, dur, residual, waits_ptr, waits, use_waits, blocking, iteration,
     rank, link) = ops
    ends = np.full(n_iter, -np.inf)
    for v in order:
        i = v >> 1
        if v & 1 == 0:
            g = gap[i]
            k = host[rank[i]]
            if k >= 0 and fixed[k]:
                g *= ratio[k, iteration[i]]
            s[i] = (e[pred[i]] if pred[i] >= 0 else anchor[i]) + g
            continue
        k = link_suspect[link[i]] if link[i] >= 0 else -1
        if how[i] == SYNC and use_waits[i]:
            ready = s[i]
            for j in range(waits_ptr[i], waits_ptr[i + 1]):
                ready = max(ready, s[waits[j]])
            r = residual[i]
            if k >= 0 and fixed[k]:
                r *= ratio[k, iteration[i]]
            e[i] = ready + r
        elif how[i] == COMPUTE:
            d = dur[i]
            k = compute[rank[i]]
            if k >= 0 and fixed[k]:
                d *= ratio[k, iteration[i]]
            e[i] = s[i] + d
        else:
            d = residual[i] if how[i] == SYNC else dur[i]
            if k >= 0 and fixed[k]:
                d *= ratio[k, iteration[i]]
            e[i] = s[i] + d
        if blocking[i] and e[i] > ends[iteration[i]]:
            ends[iteration[i]] = e[i]
    return ends


@njit(cache=True)
def _renamed(order: np.ndarray, pred: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Ops renamed in the order their ends come in ``order``: the old name of
    each new one and the reverse, the order and the preds in new names."""
    n = len(pred)
    perm = np.empty(n, np.int32)
    inv = np.empty(n, np.int32)
    j = 0
    for v in order:
        if v & 1:
            perm[j] = v >> 1
            inv[v >> 1] = j
            j += 1
    renamed = np.empty_like(order)
    for k in range(len(order)):
        renamed[k] = 2 * inv[order[k] >> 1] + (order[k] & 1)
    new_pred = np.empty(n, np.int32)
    for j in range(n):
        p = pred[perm[j]]
        new_pred[j] = inv[p] if p >= 0 else -1
    return perm, inv, renamed, new_pred


@njit(cache=True)
def _renamed_waits(ptr: np.ndarray, waits: np.ndarray, perm: np.ndarray,
                   inv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The waits CSR in new names (each list in its order)."""
    out_ptr = np.zeros(len(perm) + 1, np.int64)
    for j in range(len(perm)):
        out_ptr[j + 1] = out_ptr[j] + ptr[perm[j] + 1] - ptr[perm[j]]
    out = np.empty(out_ptr[-1], np.int32)
    for j in range(len(perm)):
        base = out_ptr[j] - ptr[perm[j]]
        for k in range(ptr[perm[j]], ptr[perm[j] + 1]):
            out[base + k] = inv[waits[k]]
    return out_ptr, out


@dataclass(frozen=True)
class Replayer:
    """A batch's graph, ordered once, replayed under any number of scenarios.
    The replay reads its ops renamed in the order their ends are reached, so
    that one pass walks memory nearly in sequence (``packed``)."""

    graph: Graph
    use_waits: np.ndarray
    residual: np.ndarray  # the graph's, with the duration where waits were dropped
    order: np.ndarray  # the nodes in dependency order, renamed
    packed: tuple[np.ndarray, ...]  # _replay's op arrays, renamed
    scratch: tuple[np.ndarray, np.ndarray]  # starts and ends, reused by every replay

    @classmethod
    def of(cls, g: Graph) -> "Replayer":
        order, use_waits = dependency_order(g)
        residual = np.where(use_waits, g.residual, g.dur)
        perm, inv, renamed, pred = _renamed(order, g.pred)
        waits_ptr, waits = _renamed_waits(g.waits_ptr, g.waits, perm, inv)
        packed = (g.how[perm], pred, g.gap[perm], g.anchor[perm], g.dur[perm], residual[perm],
                  waits_ptr, waits, use_waits[perm], g.blocking[perm], g.iteration[perm],
                  g.rank[perm], g.link[perm])
        return cls(g, use_waits, residual, renamed, packed, (np.empty(len(g)), np.empty(len(g))))

    def ends(self, suspects: Suspects, fixed: np.ndarray) -> np.ndarray:
        """Each iteration's end with the suspects ``fixed`` marks at their ratios."""
        return _replay(self.order, self.packed, *self.scratch, len(self.graph.iterations),
                       suspects.compute, suspects.host, suspects.link, suspects.ratio, fixed)

    def recorded_ends(self) -> np.ndarray:
        """Each iteration's end as recorded (a replay fixing nothing)."""
        return self.ends(Suspects.none(self.graph), np.zeros(0, np.bool_))


@dataclass(frozen=True)
class CriticalShare:
    """Per iteration, the seconds of its critical path each rank held:
    computing, between ops (host time), or in a transfer or collective it
    finished last."""

    ranks: np.ndarray
    compute: np.ndarray  # iterations x ranks
    host: np.ndarray
    communication: np.ndarray


def critical_share(r: Replayer) -> CriticalShare:
    """Walk each iteration's critical path back from its last end: an end
    comes from its op's own start unless a partner started later (then from
    that partner's start); a start comes from its pred's end."""
    g = r.graph
    ranks, where = distinct_ints(g.rank)
    shape = (len(g.iterations), len(ranks))
    held = {name: np.zeros(shape) for name in ("compute", "host", "communication")}
    last = _last_ends(g.iteration, np.where(g.blocking, g.end, -np.inf), len(g.iterations))
    for it, j in enumerate(last.tolist()):
        steps = 0
        while j >= 0 and g.iteration[j] == it and steps <= len(g):
            steps += 1
            col = where[j]
            if g.how[j] == COMPUTE:
                held["compute"][it, col] += g.dur[j]
            else:
                held["communication"][it, col] += r.residual[j]
                later = _latest_partner(r, j)
                if later >= 0:  # the path goes on from that partner's start
                    j, col = later, where[later]
            held["host"][it, col] += max(g.gap[j], 0.0)
            j = int(g.pred[j])
    return CriticalShare(ranks, held["compute"], held["host"], held["communication"])


def _last_ends(iteration: np.ndarray, ends: np.ndarray, iterations: int) -> np.ndarray:
    """Per iteration, the op that ends it (the latest finite end; of equal
    ends, the one with the highest index; -1: none)."""
    order = np.argsort(ends, kind="stable")
    order = order[np.isfinite(ends[order])]
    place = np.full(iterations, -1, np.int64)
    np.maximum.at(place, iteration[order], np.arange(len(order)))
    return np.where(place >= 0, order[np.maximum(place, 0)], -1) if len(order) else place


def _latest_partner(r: Replayer, j: int) -> int:
    """The partner whose late start the sync member ``j`` waited for (-1: none)."""
    g = r.graph
    if g.how[j] != SYNC or not r.use_waits[j]:
        return -1
    partners = g.waits[g.waits_ptr[j]:g.waits_ptr[j + 1]]
    if not len(partners):
        return -1
    k = int(partners[np.argmax(g.start[partners])])
    return k if g.start[k] > g.start[j] else -1
