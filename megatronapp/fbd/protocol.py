"""Untimed models of workers, control threads and collectives.

Workers run a program: the ids of the groups they join, in order; a worker
blocks on each collective until it has run. Control threads serve the workers
mapped onto them. Three ways to decide when a control thread runs a collective:

- ``CoordinatedSystem``: the production round loop (``control.control_thread``
  with the bit-vector ``Coordinator``, the code both backends run), untimed;
- ``ModelSystem``: what that loop must do, stated without bit vectors (the
  reference the stateful tests compare it with);
- ``NaiveSystem``: launch on the first local request, FIFO. The control
  thread is then blocked inside that collective until all its members have
  joined, which deadlocks on the paper's example.

Both expose ``events()``: the transitions enabled now, so tests (and
hypothesis) can drive any interleaving and detect a deadlock as "not finished
and nothing enabled".
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping, Sequence

from .control import Align, Aligned, ControlOp, Execute, Nap, Requests, control_thread
from .coordinator import Coordinator, GroupTable, Launch, or_tables

Programs = Mapping[int, Sequence[int]]  # worker -> group ids, in order


@dataclass(frozen=True, slots=True)
class Executed:
    """One collective instance that ran: (group, seq) and who took part."""

    group: int
    seq: int
    members: tuple[int, ...]


def check_programs(table: GroupTable, owner: Mapping[int, int], programs: Programs) -> None:
    for worker, program in programs.items():
        if worker not in owner:
            raise ValueError(f"worker {worker} has no control thread")
        for gid in program:
            if worker not in table.groups[gid]:
                raise ValueError(f"worker {worker} joins group {gid} it is not a member of")


def project(table: GroupTable, sequence: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """Per-worker programs of a consistent global collective sequence."""
    programs: dict[int, list[int]] = defaultdict(list)
    for gid in sequence:
        for w in table.groups[gid]:
            programs[w].append(gid)
    return {w: tuple(p) for w, p in programs.items()}


@dataclass
class _Workers:
    """Program counters of the workers and which are blocked in a request."""

    programs: Programs
    position: dict[int, int] = field(default_factory=dict)
    waiting: set[int] = field(default_factory=set)
    executed: list[Executed] = field(default_factory=list)
    _seq: dict[int, int] = field(default_factory=lambda: defaultdict(int))

    def __post_init__(self) -> None:
        self.position = {w: 0 for w in self.programs}

    def current(self, worker: int) -> int | None:
        program, pos = self.programs[worker], self.position[worker]
        return program[pos] if pos < len(program) else None

    def idle(self) -> list[int]:
        return [w for w in sorted(self.programs)
                if w not in self.waiting and self.current(w) is not None]

    def finished(self) -> bool:
        return not self.waiting and all(self.current(w) is None for w in self.programs)

    def release(self, group: int, members: tuple[int, ...]) -> None:
        for w in members:
            if w not in self.waiting or self.current(w) != group:
                raise AssertionError(f"collective on group {group} ran without worker {w}")
        for w in members:
            self.waiting.discard(w)
            self.position[w] += 1
        self.executed.append(Executed(group, self._seq[group], members))
        self._seq[group] += 1


class CoordinatedSystem:
    """Workers served by the production control threads (``control.control_thread``
    over ``Requests`` and a ``Coordinator`` each), interpreted untimed: an
    ``Align`` waits for the round, an ``Execute`` is a blocking rendezvous of
    the control threads of the launched group's members (a control thread
    that executed out of order would deadlock here)."""

    def __init__(self, table: GroupTable, owner: Mapping[int, int], programs: Programs):
        check_programs(table, owner, programs)
        self.table = table
        self.owner = dict(owner)
        self.workers = _Workers(programs)
        threads = sorted(set(self.owner.values()))
        self.coordinators = {c: Coordinator(table, [w for w, o in self.owner.items() if o == c])
                             for c in threads}
        self.requests = {c: Requests[int](coord) for c, coord in self.coordinators.items()}
        self.programs = {c: control_thread(self.requests[c], partial(self._working, c), 0.0)
                         for c in threads}
        self.at: dict[int, ControlOp | None] = {c: None for c in threads}  # None: parked
        self.stopped: set[int] = set()
        self.round_log: list[tuple[int, ...]] = []  # ready groups of each round

    def _working(self, thread: int) -> bool:
        return any(self.workers.current(w) is not None
                   for w in self.workers.programs if self.owner[w] == thread)

    def request(self, worker: int) -> None:
        gid = self.workers.current(worker)
        if gid is None or worker in self.workers.waiting:
            raise ValueError(f"worker {worker} cannot request now")
        self.requests[self.owner[worker]].post(worker, gid, worker)
        self.workers.waiting.add(worker)

    def not_contributed(self) -> list[int]:
        """Control threads that have not entered the current alignment yet."""
        return [c for c, op in self.at.items() if op is None and c not in self.stopped]

    def contribute(self, thread: int) -> None:
        """One control thread enters the alignment all-reduce (others may lag)."""
        self._resume(thread, None)

    def _resume(self, thread: int, value: Any) -> None:
        try:
            op = self.programs[thread].send(value)
        except StopIteration:
            self.at[thread] = None
            self.stopped.add(thread)
            return
        self.at[thread] = None if isinstance(op, Nap) else op

    def complete_round(self) -> list[Launch]:
        """The all-reduce finishes once every control thread has entered it;
        then the ready operations run as blocking rendezvous."""
        if self.stopped:
            raise ValueError("the control threads have stopped")
        for c in self.not_contributed():
            self.contribute(c)
        aligns = {c: op for c, op in self.at.items() if isinstance(op, Align)}
        merged = or_tables(op.table for op in aligns.values())
        reply = Aligned(merged, any(op.active for op in aligns.values()))
        launched_before = {c: len(coord.launched) for c, coord in self.coordinators.items()}
        for c in aligns:
            self._resume(c, reply)
        self._execute_all()
        launches = [l for c, coord in self.coordinators.items()
                    for l in coord.launched[launched_before[c]:]]
        self.round_log.append(tuple(sorted({l.group for l in launches})))
        return launches

    def _execute_all(self) -> None:
        """Run the executions whose control threads have all reached them,
        lowest group first, until none is left."""
        while True:
            executing = {c: (op.launch.group, op.launch.seq) for c, op in self.at.items()
                         if isinstance(op, Execute)}
            if not executing:
                return
            runnable = sorted(instance for instance in executing.values()
                              if all(executing.get(self.owner[w]) == instance
                                     for w in self.table.groups[instance[0]]))
            if not runnable:
                raise AssertionError(f"control threads deadlocked executing {executing}")
            gid, _ = runnable[0]
            group = self.table.groups[gid]
            self.workers.release(gid, group)
            for thread in sorted({self.owner[w] for w in group}):
                self._resume(thread, None)

    def finished(self) -> bool:
        return self.workers.finished()

    def events(self) -> list[tuple[str, Callable[[], object]]]:
        out: list[tuple[str, Callable[[], object]]] = [
            (f"request {w}", partial(self.request, w)) for w in self.workers.idle()]
        out += [(f"contribute {c}", partial(self.contribute, c))
                for c in self.not_contributed()]
        if not self.stopped and not self.finished():
            out.append(("round", self.complete_round))
        return out


class ModelSystem:
    """The untimed model the coordinator must agree with, without bit vectors:
    a worker blocks in one request at a time; a control thread's snapshot is
    the set of its workers waiting when it enters the alignment; a group
    instance is ready in a round when every member is waiting on it in its
    thread's snapshot; ready instances run in ascending group order; a thread
    that ran one enters the next alignment at once, the others nap (enter when
    told, or when the round completes)."""

    def __init__(self, table: GroupTable, owner: Mapping[int, int], programs: Programs):
        check_programs(table, owner, programs)
        self.table = table
        self.owner = dict(owner)
        self.workers = _Workers(programs)
        self.snapshots: dict[int, frozenset[int]] = {}

    def request(self, worker: int) -> None:
        if self.workers.current(worker) is None or worker in self.workers.waiting:
            raise ValueError(f"worker {worker} cannot request now")
        self.workers.waiting.add(worker)

    def not_contributed(self) -> list[int]:
        return [c for c in sorted(set(self.owner.values())) if c not in self.snapshots]

    def contribute(self, thread: int) -> None:
        self.snapshots[thread] = frozenset(w for w in self.workers.waiting
                                           if self.owner[w] == thread)

    def complete_round(self) -> tuple[int, ...]:
        for c in self.not_contributed():
            self.contribute(c)
        seen = frozenset().union(*self.snapshots.values())
        ready = [gid for gid, members in enumerate(self.table.groups)
                 if all(w in seen and self.workers.current(w) == gid for w in members)]
        for gid in ready:
            self.workers.release(gid, self.table.groups[gid])
        busy = {self.owner[w] for gid in ready for w in self.table.groups[gid]}
        self.snapshots = {}
        for c in sorted(busy):
            self.contribute(c)
        return tuple(ready)


class NaiveSystem:
    """Launch on first request: a control thread joins the collective of its
    oldest queued request and is blocked there until it completes."""

    def __init__(self, table: GroupTable, owner: Mapping[int, int], programs: Programs):
        check_programs(table, owner, programs)
        self.table = table
        self.owner = dict(owner)
        self.workers = _Workers(programs)
        self.queues: dict[int, deque[int]] = {c: deque() for c in set(self.owner.values())}
        self.busy: dict[int, int | None] = {c: None for c in self.queues}

    def request(self, worker: int) -> None:
        gid = self.workers.current(worker)
        if gid is None or worker in self.workers.waiting:
            raise ValueError(f"worker {worker} cannot request now")
        self.workers.waiting.add(worker)
        self.queues[self.owner[worker]].append(worker)
        self._complete_ready()

    def step(self, thread: int) -> None:
        if self.busy[thread] is not None or not self.queues[thread]:
            raise ValueError(f"control thread {thread} cannot launch now")
        worker = self.queues[thread].popleft()
        self.busy[thread] = self.workers.current(worker)
        self._complete_ready()

    def _complete_ready(self) -> None:
        for gid in sorted({g for g in self.busy.values() if g is not None}):
            members = self.table.groups[gid]
            threads = {self.owner[w] for w in members}
            joined = all(w in self.workers.waiting and self.workers.current(w) == gid
                         for w in members)
            if joined and all(self.busy[c] == gid for c in threads):
                for c in threads:
                    self.busy[c] = None
                    self.queues[c] = deque(w for w in self.queues[c] if w not in members)
                self.workers.release(gid, members)

    def finished(self) -> bool:
        return self.workers.finished()

    def events(self) -> list[tuple[str, Callable[[], object]]]:
        out: list[tuple[str, Callable[[], object]]] = [
            (f"request {w}", partial(self.request, w)) for w in self.workers.idle()]
        out += [(f"launch {c}", partial(self.step, c)) for c in sorted(self.queues)
                if self.busy[c] is None and self.queues[c]]
        return out

    def deadlocked(self) -> bool:
        return not self.finished() and not self.events()


def drive(system: CoordinatedSystem | NaiveSystem, choices: Sequence[int],
          max_steps: int = 10_000) -> list[str]:
    """Fire enabled events, the i-th picked by ``choices[i]`` (then the first
    enabled one), until finished or stuck; returns the fired event labels."""
    fired: list[str] = []
    idle_rounds = 0
    for step in range(max_steps):
        events = system.events()
        if not events or system.finished():
            break
        label, fire = events[choices[step] % len(events) if step < len(choices) else 0]
        before = len(system.workers.executed)
        fire()
        fired.append(label)
        idle_rounds = idle_rounds + 1 if label == "round" and before == len(
            system.workers.executed) and not system.workers.idle() else 0
        if idle_rounds >= 2:
            break  # every worker blocked and a full round launched nothing
    return fired
