"""The adaptive policy as a pure object: called directly with what a rank sees."""
from __future__ import annotations

from megatronapp.dpp.policies import AdaptiveGreedy, RankView, forward_fits
from megatronapp.parallel.schedules import PipeShape, Task

SHAPE = PipeShape(pp=2, vpp=2, microbatches=4)
POLICY = AdaptiveGreedy.planned("breadth", 0, SHAPE, max_pending_sends=2)
PLAN_POS = POLICY.priority


def view(fwd=(), bwd=(), live=0, cap=100, head=0, head_slots=0, pf=0, pb=0) -> RankView:
    return RankView(tuple(fwd), tuple(bwd), live, cap, head, head_slots, SHAPE.vpp, pf, pb)


def test_nothing_ready_means_wait() -> None:
    assert POLICY.choose(view()) is None


def test_runs_the_earliest_planned_ready_task_even_out_of_plan_order() -> None:
    f_late, f_early = Task("F", 3, 0), Task("F", 1, 0)
    assert PLAN_POS[f_early] < PLAN_POS[f_late]
    assert POLICY.choose(view(fwd=[f_late, f_early])) == f_early
    # The planned-next task's input is missing: another ready task runs instead of stalling.
    assert POLICY.choose(view(fwd=[f_late])) == f_late


def test_congested_direction_yields_to_the_other_phase() -> None:
    f, b = Task("F", 3, 1), Task("B", 0, 1)
    first, second = sorted((f, b), key=PLAN_POS.__getitem__)
    pending = {"F": "pf", "B": "pb"}
    calm = view(fwd=[f], bwd=[b])
    assert POLICY.choose(calm) == first
    jammed = view(fwd=[f], bwd=[b], **{pending[first.phase]: 2})
    assert POLICY.choose(jammed) == second
    both = view(fwd=[f], bwd=[b], pf=2, pb=2)
    assert POLICY.choose(both) == first


def test_memory_admission_keeps_room_for_everything_the_oldest_microbatch_can_hold() -> None:
    head_task, other = Task("F", 0, 1), Task("F", 2, 0)
    # The head holds 1 of its 2 possible slots: the 3 other slots + 1 + 2 > 5.
    tight = view(live=4, cap=5, head=0, head_slots=1)
    assert forward_fits(tight, head_task) and not forward_fits(tight, other)
    # The head holds both of its slots: 2 others + 1 + 2 <= 5.
    assert forward_fits(view(live=4, cap=5, head=0, head_slots=2), other)
    assert not forward_fits(view(live=5, cap=5, head=0, head_slots=1), head_task)


def test_a_full_memory_falls_back_to_backward() -> None:
    f, b = Task("F", 2, 0), Task("B", 0, 1)
    assert POLICY.choose(view(fwd=[f], bwd=[b], live=4, cap=4)) == b
    assert POLICY.choose(view(fwd=[f], live=4, cap=4)) is None
