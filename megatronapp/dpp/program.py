"""The adaptive rank program: asynchronous P2P and a greedy choice per task.

Every receive of an iteration is posted up front (the receive queue), every
output is sent without waiting (the send queue); arrived tensors and outputs
still on the wire sit in four buffers. Before each task the rank collects
what has completed and asks the policy which ready task to run. Like every
rank program it only yields operations, so it runs unchanged on the
simulator and on torch.

Non-blocking completion checks use ``WaitAny``'s contract (it returns the
lowest complete index): appending a handle known to be complete turns it
into a poll that never blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..scenario.config import Scenario
from ..parallel.ops import IRecv, RankProgram, Wait, WaitAny
from ..program.ranks import (CapturePricing, PipelineContext, StagesFor, compute_and_send,
                        finish_iteration, pipeline_contexts, task_meta)
from ..parallel.schedules import Order, PipeShape, Task
from .memory import MemoryExceeded, MemoryModel
from .policies import AdaptiveGreedy, RankView


@dataclass
class P2PBuffers:
    """One rank's asynchronous P2P state for one iteration."""

    forward_received: dict[Task, Any] = field(default_factory=dict)
    backward_received: dict[Task, Any] = field(default_factory=dict)
    forward_to_send: dict[Task, Any] = field(default_factory=dict)
    backward_to_send: dict[Task, Any] = field(default_factory=dict)
    recv_queue: list[tuple[Task, Any]] = field(default_factory=list)  # posted, not arrived
    send_queue: list[tuple[Task, Any]] = field(default_factory=list)  # posted, not delivered
    known_done: Any = None  # any handle already complete, for polling

    def received(self, task: Task) -> dict[Task, Any]:
        return self.forward_received if task.phase == "F" else self.backward_received

    def to_send(self, task: Task) -> dict[Task, Any]:
        return self.forward_to_send if task.phase == "F" else self.backward_to_send

    def pending(self) -> list[tuple[Task, Any]]:
        return self.recv_queue + self.send_queue

    def queue_send(self, task: Task, handle: Any) -> None:
        """An output posted to the wire stays buffered until delivered."""
        self.send_queue.append((task, handle))
        self.to_send(task)[task] = handle

    def complete(self, index: int) -> RankProgram:
        """Move entry ``index`` of ``pending()`` out of its queue."""
        if index < len(self.recv_queue):
            task, handle = self.recv_queue.pop(index)
            self.received(task)[task] = yield Wait(handle)
        else:
            task, handle = self.send_queue.pop(index - len(self.recv_queue))
            del self.to_send(task)[task]
        self.known_done = handle

    def poll(self) -> RankProgram:
        """Collect every completed transfer without blocking."""
        if self.known_done is None:
            return
        while self.pending():
            handles = tuple(h for _t, h in self.pending())
            index = yield WaitAny(handles + (self.known_done,))
            if index == len(handles):
                return
            yield from self.complete(index)

    def wait_for_input(self) -> RankProgram:
        """Block until one more input arrives."""
        if not self.recv_queue:
            raise RuntimeError("adaptive policy found no runnable task and no input to wait for")
        index = yield WaitAny(tuple(h for _t, h in self.recv_queue))
        yield from self.complete(index)

    def pending_sends(self, phase: str) -> int:
        return sum(1 for t, _h in self.send_queue if t.phase == phase)


@dataclass
class TaskProgress:
    """Which of this rank's tasks ran, and the activations they hold."""

    shape: PipeShape
    pp_rank: int
    done: set[Task] = field(default_factory=set)
    live_slots: int = 0

    def tasks(self, phase: str) -> list[Task]:
        return [Task(phase, mb, c) for c in range(self.shape.vpp)  # type: ignore[arg-type]
                for mb in range(self.shape.microbatches)]

    @property
    def finished(self) -> bool:
        return len(self.done) == 2 * self.shape.microbatches * self.shape.vpp

    def _vs(self, task: Task) -> int:
        return self.shape.virtual_stage(self.pp_rank, task.chunk)

    def ready_forward(self, p2p: P2PBuffers) -> tuple[Task, ...]:
        return tuple(t for t in self.tasks("F") if t not in self.done
                     and (self._vs(t) == 0 or t in p2p.forward_received))

    def ready_backward(self, p2p: P2PBuffers) -> tuple[Task, ...]:
        last = self.shape.num_virtual_stages - 1
        return tuple(t for t in self.tasks("B") if t not in self.done
                     and Task("F", t.microbatch, t.chunk) in self.done
                     and (self._vs(t) == last or t in p2p.backward_received))

    def head(self) -> tuple[int, int]:
        """(oldest microbatch owing a backward here, slots it holds here)."""
        for mb in range(self.shape.microbatches):
            chunks = range(self.shape.vpp)
            if any(Task("B", mb, c) not in self.done for c in chunks):
                return mb, sum(Task("F", mb, c) in self.done and Task("B", mb, c) not in self.done
                               for c in chunks)
        return self.shape.microbatches, 0

    def view(self, p2p: P2PBuffers, slot_cap: int) -> RankView:
        head, head_slots = self.head()
        return RankView(self.ready_forward(p2p), self.ready_backward(p2p), self.live_slots,
                        slot_cap, head, head_slots, self.shape.vpp,
                        p2p.pending_sends("F"), p2p.pending_sends("B"))

    def start(self, task: Task) -> None:
        if task.phase == "F":
            self.live_slots += 1

    def finish(self, task: Task) -> None:
        self.done.add(task)
        if task.phase == "B":
            self.live_slots -= 1


@dataclass(frozen=True)
class DppContext:
    pipe: PipelineContext
    policy: AdaptiveGreedy
    slot_cap: int


def post_receives(pipe: PipelineContext, iteration: int, p2p: P2PBuffers) -> RankProgram:
    """The receive queue: one IRecv per input this rank will consume."""
    shape, pp_rank = pipe.shape, pipe.pp_rank
    for phase, step, name in (("F", -1, "recv_forward"), ("B", +1, "recv_backward")):
        for chunk in range(shape.vpp):
            vs = shape.virtual_stage(pp_rank, chunk)
            if not 0 <= vs + step < shape.num_virtual_stages:
                continue
            for mb in range(shape.microbatches):
                task = Task(phase, mb, chunk)  # type: ignore[arg-type]
                handle = yield IRecv(src=pipe.peer_of(vs + step), tag=(phase, mb, vs),
                                     nbytes=pipe.costs.activation_bytes, name=name,
                                     meta=task_meta(iteration, task))
                p2p.recv_queue.append((task, handle))


def adaptive_iteration(ctx: DppContext, iteration: int, p2p: P2PBuffers) -> RankProgram:
    pipe = ctx.pipe
    yield from post_receives(pipe, iteration, p2p)
    progress = TaskProgress(pipe.shape, pipe.pp_rank)
    sends: list[Any] = []
    while not progress.finished:
        yield from p2p.poll()
        task = ctx.policy.choose(progress.view(p2p, ctx.slot_cap))
        if task is None:
            yield from p2p.wait_for_input()
            continue
        progress.start(task)
        data = p2p.received(task).pop(task, None)
        handle = yield from compute_and_send(pipe, iteration, task, data)
        progress.finish(task)
        if handle is not None:
            p2p.queue_send(task, handle)
            sends.append(handle)
    yield from finish_iteration(pipe, iteration, sends)


def adaptive_rank(ctx: DppContext) -> RankProgram:
    known_done = None
    for iteration in range(ctx.pipe.iterations):
        ctx.pipe.stages.start_iteration(iteration)
        p2p = P2PBuffers(known_done=known_done)
        yield from adaptive_iteration(ctx, iteration, p2p)
        known_done = p2p.known_done


def _no_static_order(_iteration: int) -> Order:
    raise ValueError("the adaptive schedule has no static order; it picks tasks at run time")


def adaptive_contexts(s: Scenario, stages_for: StagesFor | None = None,
                      capture: CapturePricing | None = None) -> dict[int, DppContext]:
    pipes = pipeline_contexts(s, lambda _pp: _no_static_order, stages_for, capture)
    shape = pipes[0].shape
    memory = MemoryModel.of(s, pipes[0].costs, shape)
    if memory.slot_cap < shape.vpp:  # the oldest microbatch must fit on every chunk
        raise MemoryExceeded("adaptive", 0, 0, memory.bytes_for(shape.vpp), memory.capacity_bytes)
    policies = {r: AdaptiveGreedy.planned(s.dpp.traversal, r, shape, s.dpp.max_pending_sends)
                for r in range(shape.pp)}
    return {rank: DppContext(pipe, policies[pipe.pp_rank], memory.slot_cap)
            for rank, pipe in pipes.items()}


def adaptive_programs(s: Scenario, stages_for: StagesFor | None = None,
                      capture: CapturePricing | None = None) -> dict[int, RankProgram]:
    """``capture``: MegaScope's ``CapturePricing`` for the scenario, if it observes."""
    return {rank: adaptive_rank(ctx)
            for rank, ctx in adaptive_contexts(s, stages_for, capture).items()}
