"""Rank programs, written once: generators of operations (see ops.py).

``pipeline_rank`` walks a traversal order of the task matrix. It never knows
which backend runs it: real work happens through ``ctx.stages`` (a
``StageModel``), which the simulator fills with placeholders and the torch
backend with megatron-core stages.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Generator, Protocol, Sequence

from .config import Scenario
from .costs import StageCosts, stage_costs
from .layout import pipe_shape, topology_of
from .ops import AllReduce, Compute, ISend, Op, Recv, RankProgram, Wait
from .schedules import Order, PipeShape, Task
from .topology import Topology


class StageModel(Protocol):
    """The real work behind compute operations (placeholders in simulation)."""

    does_tp_comm: bool  # True when the model runs its own TP collectives

    def forward(self, chunk: int, microbatch: int, x: Any) -> Any: ...
    def backward(self, chunk: int, microbatch: int, grad: Any) -> Any: ...
    def grad_buffer(self) -> Any: ...
    def grad_norm_sq(self) -> Any: ...
    def optimizer_step(self) -> Any: ...  # a Report (loss, grad norm) for the trace, or None
    def start_iteration(self, iteration: int) -> None: ...
    def capture_handoff(self) -> Any: ...


class CapturePricing(Protocol):
    """MegaScope's plan (``scope.cost.CapturePlan``): which tasks capture, at what price."""

    def cost_s(self, step: int, microbatch: int, vs: int, phase: str,
               tp_rank: int) -> float | None: ...
    def step_cost_s(self, step: int, stages: list[int], tp_rank: int) -> float | None: ...


class NullStages:
    """Shape-only stand-in: every call returns None."""

    does_tp_comm = False

    def forward(self, chunk: int, microbatch: int, x: Any) -> Any:
        return None

    def backward(self, chunk: int, microbatch: int, grad: Any) -> Any:
        return None

    def grad_buffer(self) -> Any:
        return None

    def grad_norm_sq(self) -> Any:
        return None

    def optimizer_step(self) -> Any:
        return None

    def start_iteration(self, iteration: int) -> None:
        return None

    def capture_handoff(self) -> Any:
        return None


@dataclass(frozen=True)
class PipelineContext:
    rank: int
    topo: Topology
    shape: PipeShape
    costs: StageCosts
    iterations: int
    order_for: OrderFor
    stages: StageModel = field(default_factory=NullStages)
    capture: CapturePricing | None = None  # MegaScope observations (priced, or run for real)

    @property
    def pp_rank(self) -> int:
        return self.topo.coord(self.rank).pp

    def peer_of(self, virtual_stage: int) -> int:
        """Global rank holding ``virtual_stage`` in this rank's dp/tp slice."""
        pp_rank, _ = self.shape.locate(virtual_stage)
        return self.topo.pp_neighbor(self.rank, pp_rank - self.pp_rank)


StagesFor = Callable[[int], StageModel]  # global rank -> its stages
OrderFor = Callable[[int], Order]  # iteration -> a rank's task order


def pipeline_contexts(s: Scenario, order_for_stage: Callable[[int], OrderFor],
                      stages_for: StagesFor | None = None,
                      capture: CapturePricing | None = None) -> dict[int, PipelineContext]:
    """One context per global rank; ``order_for_stage(pp_rank)`` orders its tasks;
    ``capture``: MegaScope's pricing for the scenario, if it observes."""
    topo, shape, costs = topology_of(s), pipe_shape(s), stage_costs(s)
    orders = {pp: order_for_stage(pp) for pp in range(shape.pp)}
    return {rank: PipelineContext(
        rank=rank, topo=topo, shape=shape, costs=costs, iterations=s.iterations,
        order_for=orders[topo.coord(rank).pp],
        stages=stages_for(rank) if stages_for else NullStages(), capture=capture)
        for rank in range(topo.world_size)}


def task_meta(iteration: int, task: Task) -> dict[str, Any]:
    return {"iteration": iteration, "microbatch": task.microbatch, "chunk": task.chunk}


def _forward_cost(ctx: PipelineContext, task: Task) -> float:
    extra = ctx.costs.logits_forward_s if ctx.shape.is_last(ctx.pp_rank, task.chunk) else 0.0
    return ctx.costs.forward_chunk_s + extra


def _tp_allreduce(ctx: PipelineContext, meta: dict[str, Any]) -> AllReduce | None:
    if ctx.topo.tp == 1 or ctx.stages.does_tp_comm:
        return None
    return AllReduce(group=ctx.topo.tp_group(ctx.rank), nbytes=ctx.costs.tp_allreduce_bytes,
                     name="tp_allreduce", meta=meta)


def run_task(ctx: PipelineContext, iteration: int, task: Task, sends: list[Any]) -> RankProgram:
    """Receive the task's input, compute, send its output (non-blocking)."""
    shape, vs = ctx.shape, ctx.shape.virtual_stage(ctx.pp_rank, task.chunk)
    meta = task_meta(iteration, task)
    forward = task.phase == "F"
    src_vs = vs - 1 if forward else vs + 1
    has_input = 0 <= src_vs < shape.num_virtual_stages
    data = None
    if has_input:
        data = yield Recv(src=ctx.peer_of(src_vs), tag=(task.phase, task.microbatch, vs),
                          nbytes=ctx.costs.activation_bytes,
                          name="recv_forward" if forward else "recv_backward", meta=meta)
    handle = yield from compute_and_send(ctx, iteration, task, data)
    if handle is not None:
        sends.append(handle)


def compute_and_send(ctx: PipelineContext, iteration: int, task: Task, data: Any
                     ) -> Generator[Op, Any, Any]:
    """Compute a task on its (already received) input and post its output;
    returns the send handle, or None at the ends of the pipeline."""
    shape, vs = ctx.shape, ctx.shape.virtual_stage(ctx.pp_rank, task.chunk)
    meta = task_meta(iteration, task)
    forward = task.phase == "F"
    dst_vs = vs + 1 if forward else vs - 1
    work = ctx.stages.forward if forward else ctx.stages.backward
    out = yield Compute(
        "forward" if forward else "backward",
        _forward_cost(ctx, task) if forward else ctx.costs.backward_chunk_s,
        run=partial(work, task.chunk, task.microbatch, data), meta=meta)
    if ctx.capture is not None:
        yield from capture_handoff(ctx, meta, ctx.capture.cost_s(
            iteration, task.microbatch, vs, task.phase, ctx.topo.coord(ctx.rank).tp))
    tp_op = _tp_allreduce(ctx, meta)
    if tp_op is not None:
        yield tp_op
    if 0 <= dst_vs < shape.num_virtual_stages:
        handle = yield ISend(dst=ctx.peer_of(dst_vs), tag=(task.phase, task.microbatch, dst_vs),
                             nbytes=ctx.costs.activation_bytes, tensor=out,
                             name="send_forward" if forward else "send_backward", meta=meta)
        return handle
    return None


def finish_iteration(ctx: PipelineContext, iteration: int, sends: Sequence[Any]) -> RankProgram:
    """Drain sends, all-reduce gradients over dp, agree on the grad norm, step."""
    meta = {"iteration": iteration}
    for handle in sends:
        yield Wait(handle)
    if ctx.topo.dp > 1:
        yield AllReduce(group=ctx.topo.dp_group(ctx.rank), nbytes=ctx.costs.grad_bytes,
                        tensor=ctx.stages.grad_buffer(), name="dp_allreduce", meta=meta)
    mp_group = ctx.topo.model_parallel_group(ctx.rank)
    if len(mp_group) > 1:
        yield AllReduce(group=mp_group, nbytes=4, tensor=ctx.stages.grad_norm_sq(),
                        name="grad_norm_allreduce", meta=meta)
    yield Compute("optimizer", ctx.costs.optimizer_s, run=ctx.stages.optimizer_step, meta=meta)
    stages = [ctx.shape.virtual_stage(ctx.pp_rank, c) for c in range(ctx.shape.vpp)]
    if ctx.capture is not None:
        yield from capture_handoff(ctx, meta, ctx.capture.step_cost_s(
            iteration, stages, ctx.topo.coord(ctx.rank).tp))


def capture_handoff(ctx: PipelineContext, meta: dict[str, Any], cost_s: float | None
                    ) -> RankProgram:
    """MegaScope: a task that captured hands its records to the writer (the
    simulator prices it, see ``scope.cost``); nothing when it captured nothing."""
    if cost_s is not None:
        yield Compute("scope_capture", cost_s, run=ctx.stages.capture_handoff, meta=meta)


def pipeline_rank(ctx: PipelineContext) -> RankProgram:
    """One rank's whole run: every iteration's tasks in the given order."""
    for iteration in range(ctx.iterations):
        ctx.stages.start_iteration(iteration)
        sends: list[Any] = []
        for task in ctx.order_for(iteration):
            yield from run_task(ctx, iteration, task, sends)
        yield from finish_iteration(ctx, iteration, sends)
