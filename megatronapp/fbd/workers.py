"""Forward and backward worker programs (generators of ops, backend agnostic).

Peers and groups are *worker ids* (see ``ranks.FbdLayout``). A forward worker
runs its stage without autograd, sends the activation downstream and the stage
input to its paired backward worker. A backward worker recomputes the forward
with autograd from that input, runs backward, sends the input gradient
upstream, joins the DP gradient all-reduce, steps the optimizer and sends the
new weights back to its forward worker for the next iteration.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from megatronapp.costs.per_op import BYTES_PER_ELEMENT, StageCosts
from megatronapp.parallel.ops import AllReduce, Compute, ISend, RankProgram, Recv, Wait

from .ranks import FbdLayout, Worker


class DecoupledStage(Protocol):
    """The real work of one virtual rank's two workers (placeholders in simulation)."""

    does_tp_comm: bool  # True when the model runs its own TP collectives

    def start_iteration(self, iteration: int) -> None: ...
    def forward_no_grad(self, microbatch: int, x: Any) -> Any: ...
    def recompute(self, microbatch: int, x: Any) -> Any: ...
    def backward(self, microbatch: int, grad: Any) -> Any: ...
    def grad_buffer(self) -> Any: ...
    def optimizer_step(self) -> Any: ...
    def weights(self) -> Any: ...
    def load_weights(self, weights: Any) -> None: ...


class NullDecoupledStage:
    """Shape-only stand-in: every call returns None."""

    does_tp_comm = False

    def start_iteration(self, iteration: int) -> None:
        return None

    def forward_no_grad(self, microbatch: int, x: Any) -> Any:
        return None

    def recompute(self, microbatch: int, x: Any) -> Any:
        return None

    def backward(self, microbatch: int, grad: Any) -> Any:
        return None

    def grad_buffer(self) -> Any:
        return None

    def optimizer_step(self) -> Any:
        return None

    def weights(self) -> Any:
        return None

    def load_weights(self, weights: Any) -> None:
        return None


@dataclass(frozen=True)
class WorkerContext:
    layout: FbdLayout
    vrank: int
    costs: StageCosts
    microbatches: int
    iterations: int
    stage: Any = field(default_factory=NullDecoupledStage)  # a DecoupledStage

    @property
    def pp_rank(self) -> int:
        return self.layout.topo.coord(self.vrank).pp

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.layout.topo.pp - 1

    def wid(self, phase: str, vrank: int | None = None) -> int:
        return self.layout.worker_id(Worker(phase, self.vrank if vrank is None else vrank))  # type: ignore[arg-type]

    def neighbour(self, phase: str, delta: int) -> int:
        return self.wid(phase, self.layout.topo.pp_neighbor(self.vrank, delta))

    def tp_workers(self, phase: str) -> tuple[int, ...]:
        return tuple(self.wid(phase, v) for v in self.layout.topo.tp_group(self.vrank))

    def dp_workers(self) -> tuple[int, ...]:
        return tuple(self.wid("B", v) for v in self.layout.topo.dp_group(self.vrank))

    @property
    def weight_bytes(self) -> int:
        return self.costs.params_per_rank * BYTES_PER_ELEMENT


def _tp_allreduce(ctx: WorkerContext, phase: str, meta: dict[str, Any]) -> AllReduce | None:
    """TP all-reduce among the workers of a TP group that sit on different
    devices; shards packed on one device share memory and skip it, and a
    model that runs its own TP collectives (megatron-core) needs none."""
    group = ctx.tp_workers(phase)
    if len(ctx.layout.devices_of(group)) < 2 or ctx.stage.does_tp_comm:
        return None
    return AllReduce(group=group, nbytes=ctx.costs.tp_allreduce_bytes, name="tp_allreduce",
                     meta=meta)


def forward_worker(ctx: WorkerContext) -> RankProgram:
    for it in range(ctx.iterations):
        ctx.stage.start_iteration(it)
        if it > 0:
            weights = yield Recv(src=ctx.wid("B"), tag=("weights", it), nbytes=ctx.weight_bytes,
                                 like=ctx.stage.weights(), name="recv_weights",
                                 meta={"iteration": it})
            ctx.stage.load_weights(weights)
        sends = []
        for mb in range(ctx.microbatches):
            meta = {"iteration": it, "microbatch": mb, "chunk": 0}
            x = None
            if not ctx.is_first:  # the first stage's input is data, read by both workers
                x = yield Recv(src=ctx.neighbour("F", -1), tag=("act", it, mb),
                               nbytes=ctx.costs.activation_bytes, name="recv_forward", meta=meta)
                sends.append((yield ISend(dst=ctx.wid("B"), tag=("input", it, mb),
                                          nbytes=ctx.costs.activation_bytes, tensor=x,
                                          name="send_input", meta=meta)))
            if ctx.is_last:
                continue  # the backward worker recomputes the last stage anyway
            y = yield Compute("forward", ctx.costs.forward_chunk_s,
                              run=partial(ctx.stage.forward_no_grad, mb, x), meta=meta)
            tp_op = _tp_allreduce(ctx, "F", meta)
            if tp_op is not None:
                yield tp_op
            sends.append((yield ISend(dst=ctx.neighbour("F", 1), tag=("act", it, mb),
                                      nbytes=ctx.costs.activation_bytes, tensor=y,
                                      name="send_forward", meta=meta)))
        for handle in sends:
            yield Wait(handle)


def backward_worker(ctx: WorkerContext) -> RankProgram:
    for it in range(ctx.iterations):
        ctx.stage.start_iteration(it)
        sends = []
        for mb in range(ctx.microbatches):
            meta = {"iteration": it, "microbatch": mb, "chunk": 0}
            sends += yield from _backward_microbatch(ctx, it, mb, meta)
        for handle in sends:
            yield Wait(handle)
        yield from _finish_iteration(ctx, it)


def _backward_microbatch(ctx: WorkerContext, it: int, mb: int, meta: dict[str, Any]):
    x = None
    if not ctx.is_first:
        x = yield Recv(src=ctx.wid("F"), tag=("input", it, mb),
                       nbytes=ctx.costs.activation_bytes, name="recv_input", meta=meta)
    extra = ctx.costs.logits_forward_s if ctx.is_last else 0.0
    yield Compute("recompute_forward", ctx.costs.forward_chunk_s + extra,
                  run=partial(ctx.stage.recompute, mb, x), meta=meta)
    tp_op = _tp_allreduce(ctx, "B", meta)
    if tp_op is not None:
        yield tp_op
    grad = None
    if not ctx.is_last:
        grad = yield Recv(src=ctx.neighbour("B", 1), tag=("grad", it, mb),
                          nbytes=ctx.costs.activation_bytes, name="recv_backward", meta=meta)
    dx = yield Compute("backward", ctx.costs.backward_chunk_s,
                       run=partial(ctx.stage.backward, mb, grad), meta=meta)
    if tp_op is not None:
        yield tp_op
    if ctx.is_first:
        return []
    handle = yield ISend(dst=ctx.neighbour("B", -1), tag=("grad", it, mb),
                         nbytes=ctx.costs.activation_bytes, tensor=dx, name="send_backward",
                         meta=meta)
    return [handle]


def _finish_iteration(ctx: WorkerContext, it: int):
    meta = {"iteration": it}
    dp_group = ctx.dp_workers()
    if len(dp_group) > 1:
        yield AllReduce(group=dp_group, nbytes=ctx.costs.grad_bytes,
                        tensor=ctx.stage.grad_buffer(), name="dp_allreduce", meta=meta)
    yield Compute("optimizer", ctx.costs.optimizer_s, run=ctx.stage.optimizer_step, meta=meta)
    if it + 1 < ctx.iterations:
        handle = yield ISend(dst=ctx.wid("F"), tag=("weights", it + 1), nbytes=ctx.weight_bytes,
                             tensor=ctx.stage.weights(), name="send_weights", meta=meta)
        yield Wait(handle)


def worker_programs(layout: FbdLayout, costs: StageCosts, microbatches: int, iterations: int,
                    stage_for: Any = None) -> dict[int, RankProgram]:
    """worker id -> program, for every forward and backward worker."""
    programs: dict[int, RankProgram] = {}
    for v in range(layout.virtual_ranks):
        stage = stage_for(v) if stage_for else NullDecoupledStage()
        ctx = WorkerContext(layout, v, costs, microbatches, iterations, stage)
        programs[layout.worker_id(Worker("F", v))] = forward_worker(ctx)
        programs[layout.worker_id(Worker("B", v))] = backward_worker(ctx)
    return programs
