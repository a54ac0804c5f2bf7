"""The communication coordinator: a bit-vector state machine with no I/O.

One coordinator runs per control thread (per device process). For every
communication group it keeps a bit vector over all workers (virtual ranks of
both instances). A round is:

1. registration: ``register(worker, group)`` sets the worker's bit;
2. alignment: ``begin_round()`` hands out the local table, the transport
   ORs the tables of all coordinators, ``finish_round(merged)`` takes it back;
3. readiness: a group is ready when its vector equals the expected one;
4. ordered execution: ready groups are launched in ascending group id.

Every coordinator sees the same merged table, so every coordinator computes
the same ready list in the same order; that is what rules out the cyclic
waits a launch-on-first-request coordinator runs into. Like h11's state
machine, an illegal call raises ``CoordinatorError`` and leaves the state as
it was.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Sequence

Group = tuple[int, ...]


class CoordinatorError(RuntimeError):
    """An illegal transition; the coordinator's state is unchanged."""


@dataclass(frozen=True)
class GroupTable:
    """Communication groups (sorted worker ids) indexed by group id."""

    groups: tuple[Group, ...]
    width: int  # bit-vector length: the number of workers

    def __post_init__(self) -> None:
        for gid, members in enumerate(self.groups):
            if not members or list(members) != sorted(set(members)):
                raise ValueError(f"group {gid} must list distinct workers in ascending order")
            if members[-1] >= self.width or members[0] < 0:
                raise ValueError(f"group {gid} has a worker outside 0..{self.width - 1}")

    @cached_property
    def expected(self) -> tuple[int, ...]:
        """Per group, the bit vector with every member's bit set."""
        return tuple(sum(1 << w for w in members) for members in self.groups)

    def __len__(self) -> int:
        return len(self.groups)


@dataclass(frozen=True, slots=True)
class Launch:
    """A ready collective: the ``seq``-th on ``group``; ``local`` are this
    coordinator's members, for which its control thread runs it."""

    group: int
    seq: int
    local: Group


class Coordinator:
    """The state machine of one control thread."""

    def __init__(self, table: GroupTable, local_workers: Iterable[int]):
        self.table = table
        self.local_workers = frozenset(local_workers)
        bad = [w for w in self.local_workers if not 0 <= w < table.width]
        if bad:
            raise ValueError(f"local workers {sorted(bad)} outside 0..{table.width - 1}")
        self._local_mask = sum(1 << w for w in self.local_workers)
        self._bits = [0] * len(table)  # registered, not yet launched
        self._seq = [0] * len(table)
        self._snapshot: tuple[int, ...] | None = None
        self.launched: list[Launch] = []
        self.rounds = 0

    # ---------------------------------------------------------- inspection
    @property
    def aligning(self) -> bool:
        return self._snapshot is not None

    def registered(self, worker: int, group: int) -> bool:
        return bool(self._bits[group] >> worker & 1)

    def pending_groups(self) -> tuple[int, ...]:
        return tuple(g for g, bits in enumerate(self._bits) if bits)

    # --------------------------------------------------------- transitions
    def register(self, worker: int, group: int) -> None:
        """A local worker plans its next collective on ``group``."""
        if not 0 <= group < len(self.table):
            raise CoordinatorError(f"no group {group}")
        if worker not in self.local_workers:
            raise CoordinatorError(f"worker {worker} is not served by this coordinator")
        if worker not in self.table.groups[group]:
            raise CoordinatorError(f"worker {worker} is not a member of group {group}")
        if self.registered(worker, group):
            # Serial within a group: the next request waits for this launch.
            raise CoordinatorError(f"worker {worker} already waits on group {group}")
        self._bits[group] |= 1 << worker

    def begin_round(self) -> tuple[int, ...]:
        """Freeze and hand out the local table for the OR all-reduce."""
        if self._snapshot is not None:
            raise CoordinatorError("a round is already in progress")
        self._snapshot = tuple(self._bits)
        return self._snapshot

    def finish_round(self, merged: Sequence[int]) -> tuple[Launch, ...]:
        """Take the OR of all tables; launch ready groups in ascending order."""
        snapshot = self._snapshot
        if snapshot is None:
            raise CoordinatorError("finish_round without begin_round")
        self._check_merged(snapshot, merged)
        launches = []
        for gid, (bits, expected) in enumerate(zip(merged, self.table.expected)):
            if bits != expected:
                continue
            local = tuple(w for w in self.table.groups[gid] if w in self.local_workers)
            if local:
                launches.append(Launch(gid, self._seq[gid], local))
        for launch in launches:  # state changes only after every check passed
            self._bits[launch.group] &= ~self.table.expected[launch.group]
            self._seq[launch.group] += 1
        self._snapshot = None
        self.rounds += 1
        self.launched += launches
        return tuple(launches)

    def _check_merged(self, snapshot: tuple[int, ...], merged: Sequence[int]) -> None:
        if len(merged) != len(self.table):
            raise CoordinatorError(f"merged table has {len(merged)} groups, expected "
                                   f"{len(self.table)}")
        for gid, (mine, bits) in enumerate(zip(snapshot, merged)):
            if bits & ~self.table.expected[gid]:
                raise CoordinatorError(f"group {gid}: bits set for non-members")
            if bits & self._local_mask != mine:
                raise CoordinatorError(f"group {gid}: merged table disagrees with the local one")


def or_tables(tables: Iterable[Sequence[int]]) -> tuple[int, ...]:
    """The bitwise-OR all-reduce, done in one process (simulation, tests)."""
    merged: list[int] | None = None
    for table in tables:
        if merged is None:
            merged = list(table)
        elif len(table) != len(merged):
            raise ValueError("tables of different lengths")
        else:
            merged = [a | b for a, b in zip(merged, table)]
    return tuple(merged or ())
