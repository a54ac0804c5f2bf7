"""Stopping a running job at an iteration boundary (the closed loop's stop).

Every rank must stop after the same iteration, or the ones that go on wait
forever for the ones that stopped. Each rank says which iteration it begins,
under a lock shared with the launcher; the launcher, asked to stop, fixes the
last iteration as the latest one any rank has begun, under the same lock, so
no rank can begin a later one meanwhile. Ranks behind finish up to it; none
begins the next.
"""
from __future__ import annotations

from typing import Any

from megatronapp.parallel.ops import RankProgram

RUNNING = -2  # ``last`` while no stop is asked (-1: stop before the first iteration)


class StopSwitch:
    """Shared memory between the launcher and its ranks (pickled to spawned ones)."""

    def __init__(self, ctx: Any, world: int):
        self._lock = ctx.Lock()
        self._begun = ctx.RawArray("q", [-1] * world)  # the iteration each rank is in
        self._last = ctx.RawValue("q", RUNNING)

    def begin(self, rank: int, iteration: int) -> bool:
        """Whether ``rank`` may begin ``iteration`` (False: the job stops before it)."""
        with self._lock:
            if self._last.value != RUNNING and iteration > self._last.value:
                return False
            self._begun[rank] = iteration
            return True

    def stop(self) -> int:
        """Stop after the latest iteration begun; returns it (the same on a second call)."""
        with self._lock:
            if self._last.value == RUNNING:
                self._last.value = max(self._begun[:])
            return int(self._last.value)

    @property
    def stopped_after(self) -> int | None:
        last = int(self._last.value)
        return None if last == RUNNING else last


def stoppable(program: RankProgram, rank: int, switch: StopSwitch) -> RankProgram:
    """``program`` ending before the first operation of an iteration the job
    stops before (an iteration's operations all come after the previous one's)."""
    current, result = -1, None
    while True:
        try:
            op = program.send(result)
        except StopIteration:
            return
        iteration = getattr(op, "meta", {}).get("iteration", current)  # a Wait has none
        if iteration > current:
            if not switch.begin(rank, iteration):
                program.close()
                return
            current = iteration
        result = yield op
