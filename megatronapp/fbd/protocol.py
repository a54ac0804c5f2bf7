"""Untimed models of workers, control threads and collectives.

Workers run a program: the ids of the groups they join, in order; a worker
blocks on each collective until it has run. Control threads serve the workers
mapped onto them. Two ways to decide when a control thread runs a collective:

- ``CoordinatedSystem``: the bit-vector ``Coordinator`` (rounds of OR
  alignment, ready groups in ascending order);
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
from typing import Callable, Mapping, Sequence

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
    """Workers and control threads driven by bit-vector coordinators."""

    def __init__(self, table: GroupTable, owner: Mapping[int, int], programs: Programs):
        check_programs(table, owner, programs)
        self.table = table
        self.owner = dict(owner)
        self.workers = _Workers(programs)
        threads = sorted(set(self.owner.values()))
        self.coordinators = {c: Coordinator(table, [w for w, o in self.owner.items() if o == c])
                             for c in threads}
        self._snapshots: dict[int, tuple[int, ...]] = {}
        self.round_log: list[tuple[int, ...]] = []  # ready groups of each round

    def request(self, worker: int) -> None:
        gid = self.workers.current(worker)
        if gid is None or worker in self.workers.waiting:
            raise ValueError(f"worker {worker} cannot request now")
        self.coordinators[self.owner[worker]].register(worker, gid)
        self.workers.waiting.add(worker)

    def not_contributed(self) -> list[int]:
        """Control threads that have not entered the current alignment yet."""
        return [c for c in self.coordinators if c not in self._snapshots]

    def contribute(self, thread: int) -> None:
        """One control thread enters the alignment all-reduce (others may lag)."""
        self._snapshots[thread] = self.coordinators[thread].begin_round()

    def complete_round(self) -> list[Launch]:
        """The all-reduce finishes once every control thread has entered it."""
        for c in self.coordinators:
            if c not in self._snapshots:
                self.contribute(c)
        merged = or_tables(self._snapshots.values())
        self._snapshots.clear()
        per_thread = {c: coord.finish_round(merged) for c, coord in self.coordinators.items()}
        ready = sorted({launch.group for launches in per_thread.values() for launch in launches})
        self.round_log.append(tuple(ready))
        for gid in ready:  # execution in ascending group order
            members = tuple(sorted(w for launches in per_thread.values()
                                   for launch in launches if launch.group == gid
                                   for w in launch.local))
            self.workers.release(gid, members)
        return [launch for launches in per_thread.values() for launch in launches]

    def finished(self) -> bool:
        return self.workers.finished()

    def events(self) -> list[tuple[str, Callable[[], object]]]:
        out: list[tuple[str, Callable[[], object]]] = [
            (f"request {w}", lambda w=w: self.request(w)) for w in self.workers.idle()]
        out += [(f"contribute {c}", lambda c=c: self.contribute(c))
                for c in self.not_contributed()]
        if not self.finished():
            out.append(("round", self.complete_round))
        return out


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
            (f"request {w}", lambda w=w: self.request(w)) for w in self.workers.idle()]
        out += [(f"launch {c}", lambda c=c: self.step(c)) for c in sorted(self.queues)
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
