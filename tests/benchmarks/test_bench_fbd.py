"""Coordinator cost per round: against the number of groups (linear) and
against a lock/condition-variable coordinator.

    .venv/bin/python -m pytest tests/benchmarks/test_bench_fbd.py --benchmark-enable -p no:xdist

A round here = every member of every group registers (one bit each), the
tables of all coordinators are ORed, and the ready groups come back in order.
"""
from __future__ import annotations

import pytest

from megatronapp.fbd.baselines import LockCoordinator
from megatronapp.fbd.coordinator import Coordinator, GroupTable, or_tables

GROUP_SIZE = 4
COORDINATORS = 4


WORKERS = 64  # the bit-vector length stays fixed; only the number of groups grows


def table_of(groups: int) -> GroupTable:
    """Groups of GROUP_SIZE consecutive workers (wrapping), every group with one
    member on each coordinator (workers go round-robin over coordinators)."""
    starts = [(g * GROUP_SIZE) % WORKERS for g in range(groups)]
    return GroupTable(tuple(tuple(range(s, s + GROUP_SIZE)) for s in starts), WORKERS)


def bitvector_round(table: GroupTable, coords: list[Coordinator]) -> int:
    for gid, members in enumerate(table.groups):
        for w in members:
            coords[w % COORDINATORS].register(w, gid)
    merged = or_tables([c.begin_round() for c in coords])
    return sum(len(c.finish_round(merged)) for c in coords)


def lock_round(lock: LockCoordinator, table: GroupTable) -> int:
    for gid, members in enumerate(table.groups):
        for _ in members:
            lock.arrive(gid)
    return len(lock.drain())


@pytest.mark.parametrize("groups", [16, 64, 256])
def test_bench_bitvector_round(benchmark, groups):
    table = table_of(groups)
    coords = [Coordinator(table, [w for w in range(table.width) if w % COORDINATORS == c])
              for c in range(COORDINATORS)]
    launched = benchmark(bitvector_round, table, coords)
    assert launched == groups * COORDINATORS  # each group has a member on every coordinator


@pytest.mark.parametrize("groups", [16, 64, 256])
def test_bench_lock_condition_round(benchmark, groups):
    table = table_of(groups)
    lock = LockCoordinator(table.groups)
    assert benchmark(lock_round, lock, table) == groups


@pytest.mark.parametrize("groups", [16, 64, 256])
def test_bench_alignment_only(benchmark, groups):
    """The part that is the coordinator's own overhead: OR + readiness scan."""
    table = table_of(groups)
    coords = [Coordinator(table, [w for w in range(table.width) if w % COORDINATORS == c])
              for c in range(COORDINATORS)]

    def align() -> int:
        merged = or_tables([c.begin_round() for c in coords])
        return sum(len(c.finish_round(merged)) for c in coords)

    assert benchmark(align) == 0
