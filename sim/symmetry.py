"""Exact symmetry reduction: pipelines whose timelines must be identical.

A pipeline (the ranks of one dp/tp slice, one per stage) exchanges
point-to-point messages only inside itself and meets other pipelines only in
collectives: TP and model-parallel groups among the pipelines of one replica
(same dp), DP groups among the pipelines of one column (same tp). Two
pipelines run identical timelines when their devices and internal links are
identical and, round after round, their replica and column hold the same
multiset of pipeline classes with collectives of the same cost (colour
refinement to an equitable partition). Anything random (compute jitter, a
jittered link) makes what it touches unique, so nothing random is ever shared.
Clock skew changes no simulated time (it is applied to the recorded times of
each rank when a local-clock view is asked for), so it splits nothing.

One representative per class is simulated; a collective of a representative
waits for the representatives of every class in its group (its rendezvous).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from megatronapp.program.compiled import GROUP_KINDS, embedding_group, kind_group, pipe_ranks
from megatronapp.parallel.topology import Topology

from .cluster import Cluster


@dataclass(frozen=True)
class PipeClasses:
    """Pipelines with identical timelines; each class lists its pipes, the first
    (lowest) being the one simulated."""

    topo: Topology
    classes: tuple[tuple[int, ...], ...]

    @property
    def representatives(self) -> tuple[int, ...]:
        return tuple(c[0] for c in self.classes)

    @property
    def reduced(self) -> bool:
        return len(self.classes) < self.topo.dp * self.topo.tp

    def class_of_pipe(self) -> list[int]:
        out = [0] * (self.topo.dp * self.topo.tp)
        for i, members in enumerate(self.classes):
            for pipe in members:
                out[pipe] = i
        return out

    def representative_rank(self) -> list[int]:
        """Global rank -> the simulated rank standing for it (same stage)."""
        topo = self.topo
        cls = self.class_of_pipe()
        reps = self.representatives
        out = []
        for rank in range(topo.world_size):
            c = topo.coord(rank)
            out.append(pipe_ranks(topo, reps[cls[c.dp * topo.tp + c.tp]])[c.pp])
        return out

    def rendezvous(self, rank: int, kind: int, rep_of: list[int]) -> tuple[Hashable, int]:
        """A simulated rank's collective of ``kind``: the key shared by every
        representative of its group, and how many representatives arrive."""
        stand_ins = tuple(sorted({rep_of[m] for m in kind_group(self.topo, kind, rank)}))
        return (GROUP_KINDS[kind], stand_ins), len(stand_ins)


def identity_classes(topo: Topology) -> PipeClasses:
    return PipeClasses(topo, tuple((p,) for p in range(topo.dp * topo.tp)))




class _Signatures:
    def __init__(self, cluster: Cluster):
        self.topo = cluster.topo
        self.devices = cluster.devices
        self.network = cluster.network

    def link(self, a: int, b: int) -> Hashable:
        factor, sigma = self.network.factor_and_sigma(a, b)
        same = self.topo.same_node(a, b)
        return (same, self.network.bandwidth(a, b), factor, self.network.windows(a, b),
                self.network.outages(a, b),
                ("noise", min(a, b), max(a, b)) if sigma > 0 else None)

    def ring(self, group: tuple[int, ...]) -> Hashable:
        return self.network.ring(group).signature() or ("noise", group)

    def pipe(self, pipe: int) -> Hashable:
        ranks = pipe_ranks(self.topo, pipe)
        devices = tuple(self.devices[r].signature for r in ranks)
        links = tuple(self.link(ranks[i], ranks[j]) for i in range(len(ranks))
                      for j in range(i + 1, len(ranks)))
        return devices, links, self.ring(embedding_group(ranks))

    def replica(self, dp: int) -> Hashable:
        """TP groups of every stage and the model-parallel group of replica ``dp``."""
        topo = self.topo
        first = [topo.rank(dp, p, 0) for p in range(topo.pp)]
        return (tuple(self.ring(topo.tp_group(r)) for r in first),
                self.ring(topo.model_parallel_group(first[0])))

    def column(self, tp: int) -> Hashable:
        """DP groups of every stage of column ``tp``."""
        topo = self.topo
        return tuple(self.ring(topo.dp_group(topo.rank(0, p, tp))) for p in range(topo.pp))


def _ids(values: list[Hashable]) -> list[int]:
    table: dict[Hashable, int] = {}
    return [table.setdefault(v, len(table)) for v in values]


def pipe_classes(cluster: Cluster) -> PipeClasses:
    """The coarsest equitable partition of pipelines (colour refinement)."""
    topo = cluster.topo
    sig = _Signatures(cluster)
    replicas = [sig.replica(d) for d in range(topo.dp)]
    columns = [sig.column(t) for t in range(topo.tp)]
    pipes = range(topo.dp * topo.tp)
    colour = _ids([(sig.pipe(p), replicas[p // topo.tp], columns[p % topo.tp]) for p in pipes])
    while True:
        in_replica = [tuple(sorted(colour[d * topo.tp:(d + 1) * topo.tp])) for d in range(topo.dp)]
        in_column = [tuple(sorted(colour[t::topo.tp])) for t in range(topo.tp)]
        refined = _ids([(colour[p], in_replica[p // topo.tp], in_column[p % topo.tp])
                        for p in pipes])
        if max(refined) == max(colour):
            break
        colour = refined
    members: dict[int, list[int]] = {}
    for p in pipes:
        members.setdefault(colour[p], []).append(p)
    return PipeClasses(topo, tuple(sorted(tuple(m) for m in members.values())))
