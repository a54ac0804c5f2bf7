"""From a scenario to one rank program per global rank (backend-agnostic)."""
from __future__ import annotations

from .compiled import NotStatic, PipeProgram, compile_pipe, pipe_ranks
from .config import Scenario
from .costs import stage_costs
from .layout import pipe_shape, topology_of
from .ops import RankProgram
from .programs import OrderFor, StagesFor, pipeline_contexts, pipeline_rank
from .schedules import Order, static_order
from .topology import Topology
from .scope.cost import capture_plan


def static_orders(s: Scenario) -> dict[int, Order]:
    """pp rank -> one iteration's task order for a static schedule."""
    shape = pipe_shape(s)
    return {r: static_order(s.schedule, r, shape, s.parallel.group_size) for r in range(shape.pp)}


def _every_iteration(order: Order) -> OrderFor:
    return lambda _iteration: order


def check_memory(s: Scenario) -> None:
    """A static schedule whose activations would not fit fails before it runs."""
    from .dpp.memory import MemoryModel, check_static_memory

    topo, shape = topology_of(s), pipe_shape(s)
    first_rank = {topo.coord(r).pp: r for r in reversed(range(topo.world_size))}
    check_static_memory(s.schedule, static_orders(s),
                        MemoryModel.of(s, stage_costs(s), shape), first_rank)


def compile_programs(programs: dict[int, RankProgram], topo: Topology) -> PipeProgram | None:
    """The programs of pipeline 0 compiled (every pipeline of a job compiles to
    the same program), or None when they are dynamic and keep the generator
    path. Pipeline 0's generators are consumed either way."""
    ranks = pipe_ranks(topo, 0)
    try:
        return compile_pipe([programs[r] for r in ranks], ranks, topo)
    except NotStatic:
        return None


def compile_static(s: Scenario) -> PipeProgram | None:
    if s.schedule == "adaptive":
        return None
    return compile_programs(rank_programs(s), topology_of(s))


def rank_programs(s: Scenario, stages_for: StagesFor | None = None) -> dict[int, RankProgram]:
    if s.schedule == "adaptive":
        from .dpp.program import adaptive_programs

        return adaptive_programs(s, stages_for, capture_plan(s))
    check_memory(s)
    orders = static_orders(s)
    contexts = pipeline_contexts(s, lambda pp: _every_iteration(orders[pp]), stages_for,
                                 capture_plan(s))
    return {r: pipeline_rank(ctx) for r, ctx in contexts.items()}
