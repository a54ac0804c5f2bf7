"""Identical data-parallel replicas of a symmetric run: judge one, stand for all.

A symmetric store (``trace.classes``) keeps one representative per class of
identical pipelines. Two replicas (the tp x pp ranks of one dp index) whose
ranks sit, position by position, in the same classes are *twins*: every
event of one is the other's, moved by the same rank offset, and so is every
op that stays inside a replica (TP collectives, pipeline transfers, the
compute). So MegaScan reads one replica of each kind (``present``) and
counts each of its ranks as many times as it has twins; the few collectives
that join replicas (the DP all-reduces) are read for every rank, since who
arrives last there depends on ranks the present replicas do not hold.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import numpy as np

from megatronapp.trace.classes import StandIns, rank_groups


@dataclass(frozen=True)
class Twins:
    """Present replica -> the replicas it stands for (itself first), in a
    job of ``tp`` x ``dp`` x ``pp`` ranks (rank = tp index + tp·(dp index + dp·stage))."""

    tp: int
    dp: int
    pp: int
    stands_for: dict[int, tuple[int, ...]]
    stand_ins: StandIns  # the store's classes, to expand the present replicas' rows
    groups: tuple[tuple[int, ...], ...] = field(default=(), compare=False)  # the store's

    @cached_property
    def joining(self) -> np.ndarray:
        """Per group of the store, whether it joins replicas."""
        return self.spanning(self.groups)

    @cached_property
    def group_table(self) -> np.ndarray:
        """Each rank's groups (``classes.rank_groups``), built once for every batch."""
        return rank_groups(self.groups, self.world)

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp

    def replica(self, rank: int) -> int:
        return (rank // self.tp) % self.dp

    @cached_property
    def present(self) -> tuple[int, ...]:
        """The ranks of the present replicas, ascending."""
        return tuple(sorted(t + self.tp * (d + self.dp * p) for d in self.stands_for
                            for p in range(self.pp) for t in range(self.tp)))

    def twins_of(self, rank: int) -> tuple[int, ...]:
        """The ranks a present ``rank`` stands for (itself first)."""
        d = self.replica(rank)
        return tuple(rank + (other - d) * self.tp for other in self.stands_for[d])

    def offsets(self, rank: int) -> tuple[int, ...]:
        """How far each twin of a present ``rank`` is from it (0 first)."""
        d = self.replica(rank)
        return tuple((other - d) * self.tp for other in self.stands_for[d])

    @cached_property
    def weight(self) -> np.ndarray:
        """Per rank of the job: the ranks it stands for (0 where not present)."""
        out = np.zeros(self.world, np.int64)
        for d, replicas in self.stands_for.items():
            for p in range(self.pp):
                lo = self.tp * (d + self.dp * p)
                out[lo:lo + self.tp] = len(replicas)
        return out

    def spans_replicas(self, group: Sequence[int]) -> bool:
        return len({self.replica(r) for r in group}) > 1

    def spanning(self, groups: Sequence[Sequence[int]]) -> np.ndarray:
        """Per group, whether it joins replicas (one pass over every member)."""
        sizes = np.array([len(g) for g in groups], np.int64)
        if not sizes.all():
            return np.array([self.spans_replicas(g) for g in groups], bool)
        replica = (np.fromiter((r for g in groups for r in g), np.int64, int(sizes.sum()))
                   // self.tp) % self.dp
        cuts = np.r_[0, np.cumsum(sizes)[:-1]]
        return np.minimum.reduceat(replica, cuts) != np.maximum.reduceat(replica, cuts)


def twins_in(stand_ins: StandIns, tp: int, dp: int, pp: int,
             groups: Sequence[Sequence[int]]) -> Twins | None:
    """The twin replicas of a symmetric job, or None where none are alike (or
    the job is not laid out tp, dp, pp, or a group joins replicas other than
    whole: then the job is read rank by rank)."""
    if tp * dp * pp != stand_ins.world or dp < 2:
        return None
    representative = stand_ins.representative()
    by_position = representative.reshape(pp, dp, tp).transpose(1, 0, 2).reshape(dp, -1)
    _, first, kind = np.unique(by_position, axis=0, return_index=True, return_inverse=True)
    kind = np.asarray(kind).ravel()
    if len(first) == dp:
        return None
    twins = Twins(tp, dp, pp, {int(first[k]): tuple(np.flatnonzero(kind == k).tolist())
                               for k in np.argsort(first)}, stand_ins,
                  tuple(tuple(g) for g in groups))
    spanning = [g for g, joins in zip(groups, twins.joining) if joins]
    return twins if _whole(twins, kind, spanning) else None


def _whole(twins: Twins, kind: np.ndarray, groups: Sequence[Sequence[int]]) -> bool:
    """Each group holds every twin of each of its ranks (a DP group holds a
    stage's tp index of every replica): at each place in a replica, as many
    members of each kind of replica as there are replicas of that kind."""
    if not groups:
        return True
    sizes = [len(g) for g in groups]
    rank = np.array([r for g in groups for r in g], np.int64)
    group = np.repeat(np.arange(len(groups)), sizes)
    replica = (rank // twins.tp) % twins.dp
    place = rank - replica * twins.tp  # the rank in replica 0 at the same place
    keys, counts = np.unique(np.stack([group, place, kind[replica]], axis=1), axis=0,
                             return_counts=True)
    return bool((counts == np.bincount(kind)[keys[:, 2]]).all())
