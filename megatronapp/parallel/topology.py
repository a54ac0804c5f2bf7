"""Global rank <-> (dp, pp, tp) in Megatron-core's default order.

tp varies fastest, then dp, then pp: rank = tp + T*(dp + D*pp). Rank numbers in
our traces therefore mean what they mean in a Megatron job.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

Group = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Coord:
    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class Topology:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, dp: int, pp: int, tp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    @cached_property
    def _coords(self) -> tuple[Coord, ...]:
        return tuple(Coord(dp=(r // self.tp) % self.dp, pp=r // (self.tp * self.dp), tp=r % self.tp)
                     for r in range(self.world_size))

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range 0..{self.world_size - 1}")
        return self._coords[rank]

    def stage(self, rank: int) -> int:
        """``coord(rank).pp``, without building every rank's coordinates."""
        return rank // (self.tp * self.dp)

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def same_node(self, a: int, b: int) -> bool:
        return self.node(a) == self.node(b)

    @cached_property
    def tp_groups(self) -> list[Group]:
        return [tuple(self.rank(d, p, t) for t in range(self.tp))
                for p in range(self.pp) for d in range(self.dp)]

    @cached_property
    def dp_groups(self) -> list[Group]:
        return [tuple(self.rank(d, p, t) for d in range(self.dp))
                for p in range(self.pp) for t in range(self.tp)]

    @cached_property
    def pp_groups(self) -> list[Group]:
        return [tuple(self.rank(d, p, t) for p in range(self.pp))
                for d in range(self.dp) for t in range(self.tp)]

    @cached_property
    def model_parallel_groups(self) -> list[Group]:
        """tp x pp ranks sharing one model replica (same dp)."""
        return [tuple(sorted(self.rank(d, p, t) for p in range(self.pp) for t in range(self.tp)))
                for d in range(self.dp)]

    def tp_group(self, rank: int) -> Group:
        c = self.coord(rank)
        return self.tp_groups[c.pp * self.dp + c.dp]

    def dp_group(self, rank: int) -> Group:
        c = self.coord(rank)
        return self.dp_groups[c.pp * self.tp + c.tp]

    def pp_group(self, rank: int) -> Group:
        c = self.coord(rank)
        return self.pp_groups[c.dp * self.tp + c.tp]

    def model_parallel_group(self, rank: int) -> Group:
        return self.model_parallel_groups[self.coord(rank).dp]

    def pp_neighbor(self, rank: int, delta: int) -> int:
        """Rank at pipeline stage (pp + delta) mod P with the same dp, tp."""
        c = self.coord(rank)
        return self.rank(c.dp, (c.pp + delta) % self.pp, c.tp)

    def label(self, rank: int) -> str:
        c = self.coord(rank)
        return f"rank {rank} (dp {c.dp}, pp {c.pp}, tp {c.tp})"

    def groups_json(self) -> dict[str, list[list[int]]]:
        return {"tp": [list(g) for g in self.tp_groups],
                "pp": [list(g) for g in self.pp_groups],
                "dp": [list(g) for g in self.dp_groups]}
