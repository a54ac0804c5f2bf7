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

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

from megatronapp.trace.classes import StandIns


@dataclass(frozen=True)
class Twins:
    """Present replica -> the replicas it stands for (itself first), in a
    job of ``tp`` x ``dp`` x ``pp`` ranks (rank = tp index + tp·(dp index + dp·stage))."""

    tp: int
    dp: int
    pp: int
    stands_for: dict[int, tuple[int, ...]]
    stand_ins: StandIns  # the store's classes, to expand the present replicas' rows

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
                               for k in np.argsort(first)}, stand_ins)
    return twins if all(_whole(twins, g) for g in groups) else None


def _whole(twins: Twins, group: Sequence[int]) -> bool:
    """A group inside one replica, or one that holds every twin of its ranks
    (a DP group holds a stage's tp index of every replica)."""
    if not twins.spans_replicas(group):
        return True
    members = set(group)
    rep = {d: first for first, replicas in twins.stands_for.items() for d in replicas}
    return all(r + (d - twins.replica(r)) * twins.tp in members
               for r in group for d in twins.stands_for[rep[twins.replica(r)]])
