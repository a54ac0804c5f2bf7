"""Which ranks exchange data in a job's layout, so that a link fault between two
ranks that never talk is refused rather than reported as measured.

Collectives are rings in group order (a link between members who are not
neighbours in the ring carries none of its traffic, as the simulator prices
it); pipeline stages send to the next and previous stage (with interleaving,
the last stage also to the first); tied embeddings are reduced between the
first and last stage; the gradient norm over the model-parallel group
(sorted ranks). Computed from one rank's coordinates: no group of the whole
job is built.
"""
from __future__ import annotations

from ..parallel.topology import Topology

__all__ = ["exchange_error", "layout_text", "peers_of"]

# in the order a message lists them
RINGS = (("tp", "tensor-parallel ring"), ("dp", "data-parallel ring"), ("pp", "pipeline"),
         ("emb", "embedding all-reduce"), ("mp", "gradient-norm all-reduce"))


def _ring_neighbours(members: list[int], rank: int) -> list[int]:
    if len(members) < 2:
        return []
    i = members.index(rank)
    return sorted({members[(i - 1) % len(members)], members[(i + 1) % len(members)]})


def _pipeline(topo: Topology, rank: int, vpp: int) -> list[int]:
    stage, last = topo.coord(rank).pp, topo.pp - 1
    out = [topo.pp_neighbor(rank, d) for d in (-1, 1) if 0 <= stage + d <= last]
    if vpp > 1 and stage in (0, last) and last > 0:  # a chunk hands over to the next chunk
        out.append(topo.pp_neighbor(rank, last if stage == 0 else -last))
    return sorted(set(out))


def peers_of(topo: Topology, rank: int, vpp: int = 1, tied_embeddings: bool = True
             ) -> dict[str, list[int]]:
    """Each way ``rank`` exchanges data -> the ranks it exchanges it with."""
    c = topo.coord(rank)
    tp = [topo.rank(c.dp, c.pp, t) for t in range(topo.tp)]
    dp = [topo.rank(d, c.pp, c.tp) for d in range(topo.dp)]
    mp = sorted(topo.rank(c.dp, p, t) for p in range(topo.pp) for t in range(topo.tp))
    ends = (0, topo.pp - 1)
    emb = [topo.pp_neighbor(rank, ends[1] if c.pp == 0 else -ends[1])] \
        if tied_embeddings and topo.pp > 1 and c.pp in ends else []
    return {"tp": _ring_neighbours(tp, rank), "dp": _ring_neighbours(dp, rank),
            "pp": _pipeline(topo, rank, vpp), "emb": emb, "mp": _ring_neighbours(mp, rank)}


def layout_text(topo: Topology, vpp: int = 1, cp: int = 1) -> str:
    parts = [f"tp {topo.tp}", f"pp {topo.pp}", f"dp {topo.dp // cp}"]
    parts += [f"cp {cp}"] * (cp > 1) + [f"vpp {vpp}"] * (vpp > 1)
    return ", ".join(parts)


def _names(ranks: list[int]) -> str:
    text = [str(r) for r in ranks]
    return text[0] if len(text) == 1 else ", ".join(text[:-1]) + " and " + text[-1]


def exchange_error(topo: Topology, a: int, b: int, vpp: int = 1, tied_embeddings: bool = True,
                   cp: int = 1) -> str | None:
    """None when ``a`` and ``b`` exchange data, else one line saying with whom
    ``a`` does."""
    ways = peers_of(topo, a, vpp, tied_embeddings)
    if any(b in ranks for ranks in ways.values()):
        return None
    said: set[int] = set()
    listed = []
    for key, what in RINGS:
        new = [r for r in ways[key] if r not in said]
        said.update(new)
        if new:
            listed.append(f"{_names(new)} ({what})")
    peers = "; ".join(listed) if listed else "none"
    return (f"ranks {a} and {b} exchange no data in {layout_text(topo, vpp, cp)}: "
            f"rank {a}'s peers are {peers}")
