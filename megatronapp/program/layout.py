"""A scenario's rank topology and pipeline shape (the lowest layer above config)."""
from __future__ import annotations

from ..scenario.config import Scenario
from ..parallel.schedules import PipeShape
from ..parallel.topology import Topology


def topology_of(s: Scenario) -> Topology:
    """Megatron orders ranks tp, cp, dp, pp: a context-parallel group's ranks sit
    where a dp·cp-wide data-parallel dimension puts them, and that is the group
    gradients are reduced over. Its ring exchange is priced in the layers' time
    (costs/context_parallel.py)."""
    p = s.parallel
    return Topology(tp=p.tp, pp=p.pp, dp=p.dp_cp, gpus_per_node=s.cluster.gpus_per_node)


def pipe_shape(s: Scenario) -> PipeShape:
    return PipeShape(pp=s.parallel.pp, vpp=s.parallel.vpp, microbatches=s.parallel.microbatches)
