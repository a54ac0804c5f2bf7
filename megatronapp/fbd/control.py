"""The control thread of a MegaFBD process, written once (sans-IO).

Every backend runs the same round loop: the simulator interprets it on SimPy
events, the torch runtime in a real thread with ``dist`` calls, and
``protocol.CoordinatedSystem`` untimed under any interleaving (the property
tests). The loop yields operations and is resumed with their results:

- ``Align(table, active)``: the OR all-reduce of this thread's bit-vector
  table over every control thread, plus "I still have work"; resumes with
  ``Aligned(merged, anyone_active)``;
- ``Execute(launch, requests)``: run one ready cross-device operation now,
  blocking, for the local workers' requests (ascending group order);
- ``Nap(seconds)``: nothing ran here this round; wait before the next one.

Workers post their cross-device operations to ``Requests``: per (worker,
group) a FIFO whose head is registered with the ``Coordinator``, the next
one once the head has been launched ("serial within a group"), so a worker
may have several non-blocking sends outstanding on one pair.
"""
from __future__ import annotations

from collections import defaultdict, deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Generator, Generic, TypeVar, Union

from .coordinator import Coordinator, Launch

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Align:
    table: tuple[int, ...]
    active: bool


@dataclass(frozen=True, slots=True)
class Aligned:
    merged: tuple[int, ...]
    anyone_active: bool


@dataclass(frozen=True, slots=True)
class Execute(Generic[T]):
    launch: Launch
    requests: tuple[T, ...]  # one per local member, in ascending worker order


@dataclass(frozen=True, slots=True)
class Nap:
    seconds: float


ControlOp = Union[Align, Execute[Any], Nap]
ControlProgram = Generator[ControlOp, Any, None]


class Requests(Generic[T]):
    """The cross-device requests of the workers one control thread serves."""

    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator
        self._queues: dict[tuple[int, int], deque[T]] = defaultdict(deque)
        self.posted = 0  # every post, for "has anything changed" checks

    def post(self, worker: int, group: int, request: T) -> None:
        """Queue a request; register it at once unless one is ahead of it."""
        queue = self._queues[(worker, group)]
        if not queue:
            self.coordinator.register(worker, group)
        queue.append(request)
        self.posted += 1

    def take(self, launch: Launch) -> tuple[T, ...]:
        """The launched requests (queue heads); the next in line registers."""
        taken = []
        for worker in launch.local:
            queue = self._queues[(worker, launch.group)]
            taken.append(queue.popleft())
            if queue:
                self.coordinator.register(worker, launch.group)
        return tuple(taken)

    def outstanding(self) -> int:
        return sum(len(q) for q in self._queues.values())


def control_thread(requests: Requests[Any], working: Callable[[], bool], nap_s: float,
                   guard: Callable[[], AbstractContextManager[Any]] = nullcontext
                   ) -> ControlProgram:
    """Rounds until no control thread has work left: align, execute the ready
    operations in ascending group order, nap after a round that ran nothing
    here. ``working()``: a local worker program is still running; ``guard``
    makes the snapshot atomic against workers posting from other threads."""
    while True:
        with guard():
            table = requests.coordinator.begin_round()
            active = working() or requests.outstanding() > 0
        reply: Aligned = yield Align(table, active)
        with guard():
            launches = requests.coordinator.finish_round(reply.merged)
            executions = [Execute(launch, requests.take(launch)) for launch in launches]
        for execution in executions:
            yield execution
        if not reply.anyone_active:
            return
        if not executions:
            yield Nap(nap_s)
