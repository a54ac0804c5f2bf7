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

from ..scenario.config import Scenario
from ..costs.per_op import StageCosts, stage_costs
from ..costs.deepspeed_pipe import train_schedule_order
from .layout import pipe_shape, topology_of
from ..parallel.ops import (AllGather, AllReduce, Compute, ISend, Op, Recv, RankProgram, ReduceScatter,
                  Send, Wait)
from ..parallel.schedules import Order, PipeShape, Task, static_order
from ..costs.taskplan import Step, TpCollective, Work, backward_plan, bucket_sizes, forward_plan
from ..parallel.topology import Topology


class StageModel(Protocol):
    """The real work behind compute operations (placeholders in simulation)."""

    does_tp_comm: bool  # True when the model runs its own TP collectives
    ties_embeddings: bool  # False when the stages keep embedding and output layer apart

    def forward(self, chunk: int, microbatch: int, x: Any) -> Any: ...
    def backward(self, chunk: int, microbatch: int, grad: Any) -> Any: ...
    def grad_buffer(self) -> Any: ...
    def grad_norm_sq(self) -> Any: ...
    def optimizer_step(self) -> Any: ...  # a Report (loss, grad norm) for the trace, or None
    def start_iteration(self, iteration: int) -> None: ...
    def param_buffer(self) -> Any: ...  # flat weights, all-gathered by a distributed optimizer
    def load_param_buffer(self, flat: Any) -> None: ...
    def capture_handoff(self) -> Any: ...


class CapturePricing(Protocol):
    """MegaScope's plan (``scope.cost.CapturePlan``): which tasks capture, at what price."""

    def cost_s(self, step: int, microbatch: int, vs: int, phase: str,
               tp_rank: int) -> float | None: ...
    def step_cost_s(self, step: int, stages: list[int], tp_rank: int) -> float | None: ...


class NullStages:
    """Shape-only stand-in: every call returns None."""

    does_tp_comm = False
    ties_embeddings = True  # as Megatron does unless told to untie them

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

    def param_buffer(self) -> Any:
        return None

    def load_param_buffer(self, flat: Any) -> None:
        return None


@dataclass
class Overlap:
    """Collectives in flight across tasks: overlapped gradient buckets (waited
    before the step) and the next iteration's parameter all-gathers (waited by
    each chunk's first forward), per chunk."""

    grad_handles: list[Any] = field(default_factory=list)
    param_gathers: dict[int, list[Any]] = field(default_factory=dict)


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
    chunk_costs: tuple[StageCosts, ...] = ()  # per model chunk (uneven splits); default costs

    def costs_of(self, chunk: int) -> StageCosts:
        return self.chunk_costs[chunk] if self.chunk_costs else self.costs

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
    topo, shape = topology_of(s), pipe_shape(s)
    orders = {pp: order_for_stage(pp) for pp in range(shape.pp)}
    chunks = {pp: tuple(stage_costs(s, pp, c) for c in range(shape.vpp)) for pp in range(shape.pp)}
    return {rank: PipelineContext(
        rank=rank, topo=topo, shape=shape, costs=chunks[topo.coord(rank).pp][0],
        chunk_costs=chunks[topo.coord(rank).pp], iterations=s.iterations,
        order_for=orders[topo.coord(rank).pp],
        stages=stages_for(rank) if stages_for else NullStages(), capture=capture)
        for rank in range(topo.world_size)}


TaskProgram = Generator[Op, Any, Any]  # a program part that returns a value


def task_meta(iteration: int, task: Task) -> dict[str, Any]:
    return {"iteration": iteration, "microbatch": task.microbatch, "chunk": task.chunk}


def _extras(ctx: PipelineContext, task: Task) -> tuple[float, float]:
    """(before, after) the task's layers: embedding and output layer (reversed in backward)."""
    c, first = ctx.costs, ctx.shape.is_first(ctx.pp_rank, task.chunk)
    last = ctx.shape.is_last(ctx.pp_rank, task.chunk)
    if task.phase == "F":
        return (c.embedding_forward_s if first else 0.0), (c.logits_forward_s if last else 0.0)
    after = c.embedding_backward_s if first else 0.0
    folded = ctx.costs_of(task.chunk).accumulation  # over the chunk's own parameters
    if folded:  # the microbatch's gradients folded into the accumulated ones
        after += folded.after_backward_s(task.microbatch)
    return (c.logits_backward_s if last else 0.0), after


TP_OPS = {"all_reduce": (AllReduce, "tp_allreduce"),
          "reduce_scatter": (ReduceScatter, "tp_reduce_scatter"),
          "all_gather": (AllGather, "tp_all_gather")}


def _issues_tp_ops(ctx: PipelineContext) -> bool:
    """The program issues TP collectives unless the stages run their own."""
    return ctx.topo.tp > 1 and not ctx.stages.does_tp_comm


def _grad_buckets(ctx: PipelineContext, task: Task) -> list[int]:
    """Overlapped gradient buckets reduced during this task (the chunk's last backward)."""
    c = ctx.costs
    if not (c.overlap_grad_reduce and ctx.topo.dp > 1 and task.phase == "B"
            and task.microbatch == ctx.shape.microbatches - 1):
        return []
    return bucket_sizes(c.grad_bytes // ctx.shape.vpp, c.bucket_bytes)


def task_plan(ctx: PipelineContext, task: Task) -> list[Step]:
    c = ctx.costs_of(task.chunk)
    before, after = _extras(ctx, task)
    if task.phase == "F":
        return forward_plan(c, c.first_layer, before, after, _issues_tp_ops(ctx))
    return backward_plan(c, c.first_layer, before, after, _issues_tp_ops(ctx),
                         _grad_buckets(ctx, task))


def _reduce_scatters_grads(ctx: PipelineContext) -> bool:
    """A distributed optimizer reduces each shard to its owner, except under
    DeepSpeed's engine, which all-reduces the whole gradient (deepspeed_pipe.py)."""
    return ctx.costs.distributed_optimizer and not ctx.costs.deepspeed


def _grad_reduce_op(ctx: PipelineContext, nbytes: int, tensor: Any, name: str,
                    meta: dict[str, Any], async_op: bool = False) -> AllReduce:
    op = ReduceScatter if _reduce_scatters_grads(ctx) else AllReduce
    return op(group=ctx.topo.dp_group(ctx.rank), nbytes=nbytes, tensor=tensor, name=name,
              meta=meta, async_op=async_op)


def run_task(ctx: PipelineContext, iteration: int, task: Task, sends: list[Any],
             overlap: Overlap | None = None) -> RankProgram:
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
        if ctx.costs.p2p_all_gather and _issues_tp_ops(ctx):
            yield AllGather(group=ctx.topo.tp_group(ctx.rank), nbytes=ctx.costs.tp_bytes,
                            name="tp_p2p_all_gather", meta=meta)
    handle = yield from compute_and_send(ctx, iteration, task, data, overlap)
    if handle is not None:
        sends.append(handle)


def _run_plan(ctx: PipelineContext, plan: list[Step], run: Any, meta: dict[str, Any],
              overlap: Overlap | None) -> TaskProgram:
    """Yield a task's steps; the real work (``run``) goes with its first piece."""
    parts = {name: sum(1 for st in plan if isinstance(st, Work) and st.name == name)
             for name in ("forward", "recompute_forward", "backward")}
    seen: dict[str, int] = {}
    out, ran = None, False
    for step in plan:
        if isinstance(step, Work):
            k = seen[step.name] = seen.get(step.name, -1) + 1
            piece = dict(meta)
            if parts[step.name] > 1:
                piece.update(part=k, parts=parts[step.name], layer=step.layer)
            real = run if step.name != "recompute_forward" and not ran else None
            result = yield Compute(step.name, step.cost_s, run=real, meta=piece)
            if real is not None:
                out, ran = result, True
        elif isinstance(step, TpCollective):
            op, name = TP_OPS[step.kind]
            yield op(group=ctx.topo.tp_group(ctx.rank), nbytes=ctx.costs.tp_bytes, name=name,
                     meta={**meta, "layer": step.layer})
        else:
            handle = yield _grad_reduce_op(ctx, step.nbytes, None, "dp_grad_bucket",
                                           {**meta, "bucket": step.index},
                                           async_op=overlap is not None)
            if overlap is not None:
                overlap.grad_handles.append(handle)
    return out


def _compute(ctx: PipelineContext, task: Task, data: Any, meta: dict[str, Any],
             overlap: Overlap | None) -> TaskProgram:
    """The task's compute and the collectives inside it; returns its output."""
    forward = task.phase == "F"
    work = ctx.stages.forward if forward else ctx.stages.backward
    run = partial(work, task.chunk, task.microbatch, data)
    gathers = overlap.param_gathers.pop(task.chunk, []) if overlap and forward else []
    if gathers:  # the chunk's first layers need the first parameter bucket
        yield Wait(gathers[0])
    out = yield from _run_plan(ctx, task_plan(ctx, task), run, meta, overlap)
    for handle in gathers[1:]:
        yield Wait(handle)
    return out


def compute_and_send(ctx: PipelineContext, iteration: int, task: Task, data: Any,
                     overlap: Overlap | None = None) -> TaskProgram:
    """Compute a task on its (already received) input and post its output;
    returns the send handle, or None at the ends of the pipeline. Without an
    ``overlap`` holder, overlapped gradient buckets are reduced blocking."""
    shape, vs = ctx.shape, ctx.shape.virtual_stage(ctx.pp_rank, task.chunk)
    meta = task_meta(iteration, task)
    forward = task.phase == "F"
    dst_vs = vs + 1 if forward else vs - 1
    out = yield from _compute(ctx, task, data, meta, overlap)
    if ctx.capture is not None:
        yield from capture_handoff(ctx, meta, ctx.capture.cost_s(
            iteration, task.microbatch, vs, task.phase, ctx.topo.coord(ctx.rank).tp))
    if not 0 <= dst_vs < shape.num_virtual_stages:
        return None
    blocking = ctx.costs.deepspeed  # DeepSpeed's p2p.send returns once it is moved
    handle = yield (Send if blocking else ISend)(
        dst=ctx.peer_of(dst_vs), tag=(task.phase, task.microbatch, dst_vs),
        nbytes=ctx.costs.activation_bytes, tensor=out,
        name="send_forward" if forward else "send_backward", meta=meta)
    return None if blocking else handle


def embedding_group(ctx: PipelineContext) -> tuple[int, ...] | None:
    """First and last pipeline stage of this rank's slice, when they tie embeddings."""
    if (not ctx.costs.embedding_grad_bytes or not ctx.stages.ties_embeddings
            or ctx.pp_rank not in (0, ctx.topo.pp - 1)):
        return None
    return (ctx.topo.pp_neighbor(ctx.rank, -ctx.pp_rank),
            ctx.topo.pp_neighbor(ctx.rank, ctx.topo.pp - 1 - ctx.pp_rank))


def _reduce_grads(ctx: PipelineContext, meta: dict[str, Any], overlapped: bool) -> RankProgram:
    if ctx.topo.dp > 1 and not overlapped:
        name = "dp_reduce_scatter" if _reduce_scatters_grads(ctx) else "dp_allreduce"
        yield _grad_reduce_op(ctx, ctx.costs.grad_bytes, ctx.stages.grad_buffer(), name, meta)
    group = embedding_group(ctx)
    if group is not None:
        yield AllReduce(group=group, nbytes=ctx.costs.embedding_grad_bytes,
                        name="embedding_allreduce", meta=meta)


def _gather_params(ctx: PipelineContext, iteration: int, overlap: Overlap | None) -> RankProgram:
    """A distributed optimizer's all-gather of updated weights: blocking, or
    (overlap_param_gather) posted per chunk and bucket for the next iteration."""
    if not ctx.costs.distributed_optimizer or ctx.topo.dp == 1:
        return
    group = ctx.topo.dp_group(ctx.rank)
    if overlap is None or not ctx.costs.overlap_param_gather:
        gathered = yield AllGather(group=group, nbytes=ctx.costs.param_bytes,
                                   tensor=ctx.stages.param_buffer(), name="dp_param_all_gather",
                                   meta={"iteration": iteration})
        ctx.stages.load_param_buffer(gathered)
        return
    if iteration + 1 >= ctx.iterations:
        return  # nothing runs after the last step
    meta = {"iteration": iteration + 1}  # the forward that consumes it
    per_chunk = ctx.costs.param_bytes // ctx.shape.vpp
    for chunk in range(ctx.shape.vpp):
        for k, nbytes in enumerate(bucket_sizes(per_chunk, ctx.costs.bucket_bytes)):
            handle = yield AllGather(group=group, nbytes=nbytes, name="dp_param_all_gather",
                                     meta={**meta, "chunk": chunk, "bucket": k}, async_op=True)
            overlap.param_gathers.setdefault(chunk, []).append(handle)


def finish_iteration(ctx: PipelineContext, iteration: int, sends: Sequence[Any],
                     overlap: Overlap | None = None) -> RankProgram:
    """Drain sends, reduce gradients over dp, agree on the grad norm, step."""
    meta = {"iteration": iteration}
    for handle in sends:
        yield Wait(handle)
    overlapped = ctx.costs.overlap_grad_reduce
    for handle in (overlap.grad_handles if overlap else []):
        yield Wait(handle)
    if overlap:
        overlap.grad_handles.clear()
    yield from _reduce_grads(ctx, meta, overlapped)
    mp_group = ctx.topo.model_parallel_group(ctx.rank)
    if len(mp_group) > 1:
        yield AllReduce(group=mp_group, nbytes=4, tensor=ctx.stages.grad_norm_sq(),
                        name="grad_norm_allreduce", meta=meta)
    yield Compute("optimizer", ctx.costs.optimizer_s, run=ctx.stages.optimizer_step, meta=meta)
    stages = [ctx.shape.virtual_stage(ctx.pp_rank, c) for c in range(ctx.shape.vpp)]
    if ctx.capture is not None:
        yield from capture_handoff(ctx, meta, ctx.capture.step_cost_s(
            iteration, stages, ctx.topo.coord(ctx.rank).tp))
    yield from _gather_params(ctx, iteration, overlap)


def capture_handoff(ctx: PipelineContext, meta: dict[str, Any], cost_s: float | None
                    ) -> RankProgram:
    """MegaScope: a task that captured hands its records to the writer (the
    simulator prices it, see ``scope.cost``); nothing when it captured nothing."""
    if cost_s is not None:
        yield Compute("scope_capture", cost_s, run=ctx.stages.capture_handoff, meta=meta)


def pipeline_rank(ctx: PipelineContext) -> RankProgram:
    """One rank's whole run: every iteration's tasks in the given order."""
    overlap = Overlap()
    for iteration in range(ctx.iterations):
        ctx.stages.start_iteration(iteration)
        sends: list[Any] = []
        for task in ctx.order_for(iteration):
            yield from run_task(ctx, iteration, task, sends, overlap)
        yield from finish_iteration(ctx, iteration, sends, overlap)


def static_orders(s: Scenario) -> dict[int, Order]:
    """pp rank -> one iteration's task order for a static schedule."""
    shape = pipe_shape(s)
    if s.parallel.pipeline_engine == "deepspeed":
        return {r: train_schedule_order(r, shape) for r in range(shape.pp)}
    return {r: static_order(s.schedule, r, shape, s.parallel.group_size) for r in range(shape.pp)}


def static_programs(s: Scenario, stages_for: StagesFor | None = None,
                    capture: CapturePricing | None = None) -> dict[int, RankProgram]:
    """Every rank's program under a static schedule (the same order each iteration)."""
    orders = static_orders(s)
    contexts = pipeline_contexts(s, lambda pp: lambda _iteration: orders[pp], stages_for, capture)
    return {r: pipeline_rank(ctx) for r, ctx in contexts.items()}


def static_compute_ops(s: Scenario, ranks: Sequence[int] | None = None) -> dict[int, list[Compute]]:
    """The compute operations each rank (of ``ranks``, default all) issues, in
    order, under a static schedule (``compiled.NotStatic`` for a dynamic one)."""
    from .compiled import record

    programs = static_programs(s)
    wanted = programs if ranks is None else [r for r in ranks if r in programs]
    return {r: [op for op in record(programs[r]) if isinstance(op, Compute)] for r in wanted}
