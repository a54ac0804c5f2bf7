"""Traversal policies over the (microbatch, chunk) task matrix.

Static traversals (Fig. 3 of the paper) are plain visit orders. The adaptive
policy is a pure object: given what one rank sees right now (which inputs
have arrived, memory in use, how many sends are still on the wire) it names
the next task, or None to wait for the network. It never does I/O, so the
same object drives the simulator and the torch backend, and tests can call
it directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

from ..parallel.schedules import (Order, PipeShape, Task, interleaved_order, one_f_one_b_order,
                         schedule_table)

Traversal = Literal["breadth", "depth"]


def depth_first_traversal(microbatches: int, chunks: int) -> list[tuple[int, int]]:
    """DFC: one microbatch through every chunk before the next microbatch."""
    return schedule_table(microbatches, chunks, 1)


def breadth_first_traversal(microbatches: int, chunks: int) -> list[tuple[int, int]]:
    """BFC: every microbatch through one chunk before the next chunk."""
    return schedule_table(microbatches, chunks, microbatches)


@dataclass(frozen=True)
class RankView:
    """What one rank knows when it picks its next task."""

    ready_forward: tuple[Task, ...]  # inputs arrived (or first stage), not run yet
    ready_backward: tuple[Task, ...]
    live_slots: int  # stored activations now
    slot_cap: int  # stored activations that fit in memory
    head_microbatch: int  # oldest microbatch this rank still owes a backward
    head_slots: int  # stored activations the head microbatch holds here
    chunks: int  # model chunks on this rank: the most one microbatch can hold
    pending_forward_sends: int  # forward outputs still on the wire
    pending_backward_sends: int


def forward_fits(view: RankView, task: Task) -> bool:
    """Memory admission that cannot deadlock.

    Invariant: the slots held by microbatches other than the oldest
    unfinished one (the head) leave room for ``chunks`` slots, all the head
    can ever hold. So the head's forwards always fit, and when the head
    finishes, the next head already lies inside the non-head share. The
    globally oldest microbatch is the head on every rank it still needs,
    so it can always advance (docs/megadpp.md).
    """
    if task.microbatch == view.head_microbatch:
        return view.live_slots + 1 <= view.slot_cap
    others = view.live_slots - view.head_slots
    return others + 1 + view.chunks <= view.slot_cap


def planned_order(traversal: Traversal, pp_rank: int, shape: PipeShape) -> Order:
    """The order the adaptive policy follows when nothing disturbs it: BFC
    (breadth) or DFC (depth) interleaving; plain 1F1B without chunks."""
    if shape.vpp == 1:
        return one_f_one_b_order(pp_rank, shape)
    group = shape.microbatches if traversal == "breadth" else min(shape.pp, shape.microbatches)
    return interleaved_order(pp_rank, shape, group)


@dataclass(frozen=True)
class AdaptiveGreedy:
    """Greedy per-rank choice from two ready queues.

    Among the ready tasks that memory admits, run the one planned earliest
    (``planned_order``: best-effort BFC by default), so an undisturbed run
    follows the plan and a late input never stalls the rank while other work
    is ready. When the link the chosen task's output takes already has
    ``max_pending_sends`` messages in flight and the other direction does
    not, the best task of the other phase goes first: a new message on the
    congested link would only queue.
    """

    priority: Mapping[Task, int]  # position of each task in the plan
    max_pending_sends: int = 2

    @classmethod
    def planned(cls, traversal: Traversal, pp_rank: int, shape: PipeShape,
                max_pending_sends: int = 2) -> "AdaptiveGreedy":
        plan = planned_order(traversal, pp_rank, shape)
        return cls({t: i for i, t in enumerate(plan)}, max_pending_sends)

    def choose(self, view: RankView) -> Task | None:
        fits = [t for t in view.ready_forward if forward_fits(view, t)]
        fwd = min(fits, key=self.priority.__getitem__, default=None)
        bwd = min(view.ready_backward, key=self.priority.__getitem__, default=None)
        if fwd is None or bwd is None:
            return fwd or bwd
        first, second = (fwd, bwd) if self.priority[fwd] < self.priority[bwd] else (bwd, fwd)
        pending = {"F": view.pending_forward_sends, "B": view.pending_backward_sends}
        if pending[first.phase] >= self.max_pending_sends > pending[second.phase]:
            return second
        return first
