"""A lock/condition-variable coordinator: the conventional scheme the
bit-vector coordinator is measured against.

Every group has a lock-protected arrival counter and a condition variable;
the last member to arrive marks the group ready and wakes the others. It needs
no alignment round, but each arrival takes a lock, and it only works among
threads of one process: across processes the counters would need a
collective per group.
"""
from __future__ import annotations

import threading
from typing import Sequence


class LockCoordinator:
    def __init__(self, groups: Sequence[Sequence[int]]):
        self.sizes = [len(g) for g in groups]
        self._arrived = [0] * len(groups)
        self._conds = [threading.Condition() for _ in groups]
        self._ready_lock = threading.Lock()
        self.ready: list[int] = []

    def arrive(self, group: int) -> bool:
        """One member arrives; True when it completed the group (no waiting
        here: the caller decides whether to block on ``wait_ready``)."""
        cond = self._conds[group]
        with cond:
            self._arrived[group] += 1
            if self._arrived[group] < self.sizes[group]:
                return False
            self._arrived[group] = 0
            cond.notify_all()
        with self._ready_lock:
            self.ready.append(group)
        return True

    def drain(self) -> list[int]:
        """Ready groups, in ascending order, as the bit-vector coordinator runs them."""
        with self._ready_lock:
            out, self.ready = sorted(self.ready), []
        return out
