"""Stopping a torch job at an iteration boundary: every rank stops after the
same iteration, the latest one any rank had begun when the stop was asked."""
from __future__ import annotations

import multiprocessing

from backends.torch.stopping import StopSwitch, stoppable
from megatronapp.parallel.ops import Compute, RankProgram, Wait


def program(iterations: int) -> RankProgram:
    """Two computations and a wait (which has no iteration) per iteration;
    what a computation resumes with goes into the next one's name."""
    got = None
    for i in range(iterations):
        for step in range(2):
            got = yield Compute(f"{i}.{step} after {got}", 0.0, meta={"iteration": i})
        yield Wait(handle=None)


def test_ranks_behind_finish_the_latest_iteration_begun_and_none_begins_another() -> None:
    switch = StopSwitch(multiprocessing.get_context("spawn"), 3)
    assert switch.begin(0, 3) and switch.begin(1, 2) and switch.stopped_after is None
    assert switch.stop() == 3 == switch.stop()  # asked twice: the same boundary
    assert switch.begin(1, 3) and switch.begin(2, 0)  # the ones behind catch up to it
    assert not switch.begin(0, 4) and not switch.begin(1, 4)
    assert switch.stopped_after == 3


def test_a_stopped_program_ends_before_the_first_operation_past_the_boundary() -> None:
    switch = StopSwitch(multiprocessing.get_context("spawn"), 2)
    switch.begin(1, 1)
    switch.stop()  # after iteration 1
    ops, gen, answer = [], stoppable(program(5), 0, switch), None
    try:
        while True:
            ops.append(gen.send(answer))
            answer = len(ops)
    except StopIteration:
        pass
    names = [op.name for op in ops if isinstance(op, Compute)]
    assert names == ["0.0 after None", "0.1 after 1", "1.0 after 2", "1.1 after 4"]
    assert isinstance(ops[-1], Wait)  # iteration 1 drained before the stop
