"""Everything about replaying a batch's dependency graph lives here: how each
of its iterations would have ended had some suspects taken their expected
time (a what-if), and the order that makes one pass enough.

Each op is two nodes, its start (``2i``) and its end (``2i + 1``). A start
waits for its pred's end; an end waits for its own start and, for a sync
member, for the starts of the partners it waited for (``graph``). One pass
in dependency order computes every node (compiled: a 12,288-GPU iteration
holds tens of millions of ops).

A scenario fixes some suspects: a fixed suspect's ops take ``factor`` x
their recorded part (a rank's compute durations, a rank's host gaps, a
link's residual transfer times); the others keep theirs. With nothing fixed
the replay gives back the recorded times.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from .graph import COMPUTE, SYNC, Graph


@njit(cache=True)
def _children(n: int, pred: np.ndarray, waits_ptr: np.ndarray, waits: np.ndarray,
              use_waits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR of each node's dependants, and each node's count of dependencies."""
    count = np.zeros(2 * n + 1, np.int64)
    indegree = np.zeros(2 * n, np.int64)
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
    child = np.empty(ptr[-1], np.int64)
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
    order = np.empty(nodes, np.int64)
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


@njit(cache=True)
def _replay(order: np.ndarray, how: np.ndarray, pred: np.ndarray, gap: np.ndarray,
            anchor: np.ndarray, dur: np.ndarray, residual: np.ndarray, waits_ptr: np.ndarray,
            waits: np.ndarray, use_waits: np.ndarray, blocking: np.ndarray,
            iteration: np.ndarray, n_iter: int, suspects: np.ndarray, factors: np.ndarray,
            fixed: np.ndarray) -> np.ndarray:
    """Each iteration's end under one scenario. ``suspects[k, i]`` is op i's
    suspect of kind k (0 compute, 1 host, 2 link; -1 none), ``factors[k, i]``
    what that suspect's fixing makes of op i's part, ``fixed[s]`` whether
    suspect s is fixed in this scenario."""
    n = len(how)
    s = np.empty(n)
    e = np.empty(n)
    ends = np.full(n_iter, -np.inf)
    for v in order:
        i = v >> 1
        if v & 1 == 0:
            g = gap[i]
            k = suspects[1, i]
            if k >= 0 and fixed[k]:
                g *= factors[1, i]
            s[i] = (e[pred[i]] if pred[i] >= 0 else anchor[i]) + g
            continue
        if how[i] == SYNC and use_waits[i]:
            ready = s[i]
            for j in range(waits_ptr[i], waits_ptr[i + 1]):
                ready = max(ready, s[waits[j]])
            r = residual[i]
            k = suspects[2, i]
            if k >= 0 and fixed[k]:
                r *= factors[2, i]
            e[i] = ready + r
        elif how[i] == COMPUTE:
            d = dur[i]
            k = suspects[0, i]
            if k >= 0 and fixed[k]:
                d *= factors[0, i]
            e[i] = s[i] + d
        else:
            d = residual[i] if how[i] == SYNC else dur[i]
            k = suspects[2, i]
            if k >= 0 and fixed[k]:
                d *= factors[2, i]
            e[i] = s[i] + d
        if blocking[i] and e[i] > ends[iteration[i]]:
            ends[iteration[i]] = e[i]
    return ends


@dataclass(frozen=True)
class Replayer:
    """A batch's graph, ordered once, replayed under any number of scenarios."""

    graph: Graph
    order: np.ndarray
    use_waits: np.ndarray
    residual: np.ndarray  # the graph's, with the duration where waits were dropped

    @classmethod
    def of(cls, g: Graph) -> "Replayer":
        order, use_waits = dependency_order(g)
        residual = np.where(use_waits, g.residual, g.dur)
        return cls(g, order, use_waits, residual)

    def ends(self, suspects: np.ndarray, factors: np.ndarray, fixed: np.ndarray) -> np.ndarray:
        """Each iteration's end with the suspects ``fixed`` marks at their factors."""
        g = self.graph
        return _replay(self.order, g.how, g.pred, g.gap, g.anchor, g.dur, self.residual,
                       g.waits_ptr, g.waits, self.use_waits, g.blocking, g.iteration,
                       len(g.iterations), suspects, factors, fixed)

    def recorded_ends(self) -> np.ndarray:
        """Each iteration's end as recorded (a replay fixing nothing)."""
        none = np.full((3, len(self.graph)), -1, np.int64)
        return self.ends(none, np.ones((3, len(self.graph))), np.zeros(0, np.bool_))


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
    ranks = np.unique(g.rank)
    where = np.searchsorted(ranks, g.rank)
    shape = (len(g.iterations), len(ranks))
    held = {name: np.zeros(shape) for name in ("compute", "host", "communication")}
    last = np.full(len(g.iterations), -1, np.int64)
    ends = np.where(g.blocking, g.end, -np.inf)
    for j in np.argsort(ends, kind="stable").tolist():
        if np.isfinite(ends[j]):
            last[g.iteration[j]] = j
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
