"""Each rank's time in each op, summed over whole iterations.

A model's layers differ in shape, so one op name (FSDP's
``AddmmBackward0``, a DDP model's ``aten::linear``) pools calls of
different lengths, and its fastest calls say which layers a rank ran as
much as how fast it ran them. An iteration runs the same layers on every
rank of a data- or tensor-parallel group, so the op's total over one
iteration compares like with like (``waits`` reads it as one more measure
of how slow a rank is at its best).

Fed batch by batch, in time order: an iteration's totals stay open until
its rank has gone on to a later one, then join a bounded sample per
(rank, op name); a row of an iteration already closed is dropped, not
counted as an iteration of its own. ``totals`` leaves out each rank's
last iteration unless another rank has gone past it (it may be partial).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable

import numpy as np

from megatronapp.trace.columns import EventColumns
from megatronapp.trace.metrics import group_ids

from megatronapp.scan.ingest.sketch import DEFAULT_CAPACITY, Reservoirs
from megatronapp.scan.align.table import COMPUTE_KIND

Key = tuple[int, str]  # (rank, op name)


class IterationTotals:
    """Per (rank, op name), the op's summed duration in each whole iteration."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self._open: dict[Key, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        self._closed: Reservoirs[Key] = Reservoirs(capacity)
        self._latest: dict[int, int] = {}  # rank -> its latest iteration fed
        self._closed_below: dict[int, int] = {}  # rank -> iterations below it are closed

    def feed(self, cols: EventColumns) -> None:
        rows = np.flatnonzero((cols.kind == COMPUTE_KIND) & (cols.dur_s > 0)
                              & (cols.iteration >= 0))
        if not len(rows):
            return
        keys = [cols.rank[rows], cols.name[rows], cols.iteration[rows]]
        ids, count = group_ids(*keys)
        sums = np.bincount(ids, cols.dur_s[rows], minlength=count)
        first = np.unique(ids, return_index=True)[1]
        distinct = zip(*(k[first].tolist() for k in keys))
        for (r, n, i), total in zip(distinct, sums.tolist()):
            if i >= self._closed_below.get(r, 0):
                self._open[(r, cols.names[n])][i] += total
                self._latest[r] = max(self._latest.get(r, i), i)
        self._close_passed()

    def _close_passed(self) -> None:
        """Move every open iteration below its rank's latest to the samples."""
        for key, by_iteration in self._open.items():
            bar = self._latest[key[0]]
            done = sorted(i for i in by_iteration if i < bar)
            if done:
                self._closed.add(key, np.array([by_iteration.pop(i) for i in done]))
                self._closed_below[key[0]] = max(self._closed_below.get(key[0], 0), bar)

    def totals(self) -> dict[int, dict[str, np.ndarray]]:
        """rank -> op name -> its totals over the whole iterations fed so far."""
        past = max(self._latest.values(), default=0)
        out: dict[int, dict[str, np.ndarray]] = {}
        for key in set(self._closed) | set(self._open):
            kept = self._closed[key] if key in self._closed else np.zeros(0)
            ended = [t for i, t in sorted(self._open.get(key, {}).items()) if i < past]
            values = np.concatenate([kept, ended]) if ended else kept
            if len(values):
                out.setdefault(key[0], {})[key[1]] = values
        return out

    def aliased(self, keys_of: Callable[[Key], Iterable[Key]]) -> "IterationTotals":
        """These totals, each also under the keys ``keys_of(key)`` (shared, not copied)."""
        out = IterationTotals(self._closed.capacity)
        out._closed = self._closed.aliased(keys_of)
        out._open.update((alias, v) for key, v in self._open.items() for alias in keys_of(key))
        out._latest.update((alias[0], self._latest[key[0]]) for key in self._open
                           for alias in keys_of(key))
        return out

    def entries(self) -> int:
        """Keys and values held (closed samples and open totals)."""
        return (len(self._closed) + self._closed.entries()
                + sum(1 + len(v) for v in self._open.values()))
