"""Everything about a symmetric trace store lives here: representatives' rows
expanded to every rank they stand for.

A simulated job with classes of identical ranks (``sim.symmetry``) records one
representative per class. Its store keeps those rows and a classes table
(representative -> the ranks it stands for, itself first; a rank in no class
is its own). A member's rows are its representative's with three fields
moved: the rank, the peer (a point-to-point peer is in the member's own
pipeline, as far from it as the representative's is from the representative)
and the group (the member's own group of the same kind: each rank's groups,
ordered by id, are one per kind in the same order, as runs number them).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from .columns import (EventColumns, EventSource, RankEventsView, TableSource, concat_same,
                      is_int32, source_of)
from .events import RunResult


@dataclass(frozen=True)
class StandIns:
    """Representative -> the ranks it stands for (itself first), for classes
    of more than one rank; ``world`` ranks in all."""

    members: Mapping[int, tuple[int, ...]]
    world: int

    def to_json(self) -> list[tuple[int, list[int]]]:
        return [(rep, list(ranks)) for rep, ranks in sorted(self.members.items())]

    @classmethod
    def from_json(cls, data: Any, world: int) -> "StandIns":
        """Classes as a store's metadata lists them; ValueError names what is wrong."""
        shape = "'classes' must be a list of [representative, [ranks it stands for]]"
        if not isinstance(data, list) or not all(
                isinstance(c, list) and len(c) == 2 and is_int32(c[0]) and isinstance(c[1], list)
                and all(map(is_int32, c[1])) for c in data):
            raise ValueError(shape)
        members = {rep: tuple(ranks) for rep, ranks in data}
        if any(not 0 <= r < world for ranks in members.values() for r in ranks) or any(
                ranks[:1] != (rep,) for rep, ranks in members.items()):
            raise ValueError(f"'classes' must list ranks of the job (0..{world - 1}), each class "
                             "led by its representative")
        return cls(members, world)

    @classmethod
    def of(cls, stand_ins: Mapping[int, tuple[int, ...]], world: int) -> "StandIns":
        """The classes of more than one rank of an ``EventSource.stand_ins``."""
        return cls({rep: ranks for rep, ranks in stand_ins.items() if len(ranks) > 1}, world)

    @property
    def reduced(self) -> bool:
        return bool(self.members)

    def representative(self) -> np.ndarray:
        """Each rank's representative (itself where it is in no class)."""
        out = np.arange(self.world, dtype=np.int64)
        for rep, ranks in self.members.items():
            out[list(ranks)] = rep
        return out

    def stands_for(self, ranks: Sequence[int]) -> list[int]:
        """The stored ranks whose rows ``ranks`` need."""
        rep = self.representative()
        return sorted({int(rep[r]) for r in ranks if 0 <= r < self.world})


def rank_groups(groups: Sequence[Sequence[int]], world: int) -> np.ndarray:
    """(world, k) array: each rank's group ids in ascending order, -1 padded."""
    sizes = [len(g) for g in groups]
    rank = np.array([r for g in groups for r in g], np.int64)
    gid = np.repeat(np.arange(len(groups), dtype=np.int64), sizes)
    keep = (rank >= 0) & (rank < world)
    pairs = np.unique(np.stack([rank[keep], gid[keep]], axis=1), axis=0)  # by rank, then id
    rank, gid = pairs[:, 0], pairs[:, 1]
    counts = np.bincount(rank, minlength=world)
    out = np.full((world, max(int(counts.max(initial=0)), 1)), -1, np.int64)
    out[rank, np.arange(len(rank)) - np.repeat(np.cumsum(counts) - counts, counts)] = gid
    return out


@dataclass(frozen=True)
class Expansion:
    """A symmetric store's rows, expanded rank by rank on demand: an
    ``EventSource`` whose ``compact`` view (the stored rows, each weighted by
    the ranks it stands for) needs no expansion at all."""

    stored: EventColumns  # the representatives' rows, grouped by rank
    classes: StandIns
    groups_of_ranks: np.ndarray | None = field(default=None, compare=False)  # ``rank_groups``, built

    @property
    def events(self) -> int:
        return int(self._weights.sum())

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        return self.stored.groups

    def compact(self) -> tuple[EventColumns, np.ndarray]:
        return self.stored, self._weights.astype(float)

    def weighted_batches(self, max_rows: int = 1 << 20) -> Iterator[tuple[EventColumns, np.ndarray]]:
        yield self.compact()  # the stored rows are in memory: one batch

    def stand_ins(self) -> dict[int, tuple[int, ...]]:
        return {rep: self.classes.members.get(rep, (rep,)) for rep in self._bounds}

    def rank_rows(self, rank: int) -> EventColumns:
        return self.rows([rank])

    @cached_property
    def _weights(self) -> np.ndarray:
        """How many ranks each stored row stands for."""
        size = np.ones(self.classes.world, np.int64)
        for rep, ranks in self.classes.members.items():
            size[rep] = len(ranks)
        return size[self.stored.rank]

    def ranks(self) -> list[int]:
        stored = np.array(sorted(self._bounds), np.int64)
        return np.flatnonzero(np.isin(self._representative, stored)).tolist()

    @cached_property
    def _bounds(self) -> dict[int, tuple[int, int]]:
        return self.stored.rank_bounds()

    def rows(self, ranks: Sequence[int]) -> EventColumns:
        """The rows of ``ranks`` (in that order), each moved from its representative's."""
        bounds = self._bounds
        rep_of = self._representative
        targets = np.array([r for r in ranks if 0 <= r < len(rep_of) and int(rep_of[r]) in bounds],
                           np.int64)
        reps = rep_of[targets]
        lo = np.array([bounds[int(r)][0] for r in reps], np.int64)
        counts = np.array([bounds[int(r)][1] for r in reps], np.int64) - lo
        starts = np.repeat(lo - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
        rows = self.stored.take(starts + np.arange(int(counts.sum())))
        member, rep = np.repeat(targets, counts), np.repeat(reps, counts)
        moved = member - rep
        peer = np.where(rows.peer >= 0, rows.peer + moved, -1).astype(rows.peer.dtype)
        group = self._groups(rows.group, rep, member)
        fields = {f: getattr(rows, f) for f in ("name", "kind", "start_s", "dur_s", "iteration",
                                                 "microbatch", "chunk", "nbytes", "role", "tag")}
        return EventColumns(rank=member.astype(np.int32), peer=peer, group=group, **fields,
                            names=rows.names, groups=rows.groups, extra=rows.extra)

    @cached_property
    def _group_table(self) -> np.ndarray:
        if self.groups_of_ranks is not None:
            return self.groups_of_ranks
        return rank_groups(self.stored.groups, self.classes.world)

    @cached_property
    def _representative(self) -> np.ndarray:
        return self.classes.representative()

    def _groups(self, group: np.ndarray, rep: np.ndarray, member: np.ndarray) -> np.ndarray:
        """Each row's group moved to the member's group of the same kind."""
        has = group >= 0
        if not has.any():
            return group
        table = self._group_table
        kind = np.argmax(table[rep[has]] == group[has, None].astype(np.int64), axis=1)
        out = group.copy()
        out[has] = table[member[has], kind]
        return out

    def batches(self, max_rows: int = 1 << 20, ranks: Sequence[int] | None = None
                ) -> Iterator[EventColumns]:
        """The rows of ``ranks`` (default: every rank, ascending), about
        ``max_rows`` at a time."""
        ranks = self.ranks() if ranks is None else ranks
        longest = max((hi - lo for lo, hi in self._bounds.values()), default=1)
        step = max(1, max_rows // max(longest, 1))
        for i in range(0, len(ranks), step):
            yield self.rows(ranks[i:i + step])


def kept_rows(result: RunResult, keep: Callable[[EventColumns], np.ndarray]) -> RunResult:
    """``result`` with only the rows ``keep`` marks (one pass over its batches:
    a reduced run's stored rows only, and it stays reduced, since a class's
    members share their representative's times)."""
    whole = source_of(result)
    stand_ins = StandIns.of(whole.stand_ins(), result.topo.world_size)
    batches = [whole.compact()[0]] if stand_ins.reduced else whole.batches()
    rows = concat_same([b.take(np.flatnonzero(keep(b))) for b in batches])
    rows = rows.sorted_by_rank_and_start()
    source: EventSource = Expansion(rows, stand_ins) if stand_ins.reduced else TableSource(rows)
    return replace(result, events=RankEventsView(source), source=source)
