"""The coordinator's state machine: readiness, order, and illegal transitions."""
from __future__ import annotations

import copy

import pytest

from megatronapp.fbd.control import Align, Aligned, Nap, Requests, control_thread
from megatronapp.fbd.coordinator import Coordinator, CoordinatorError, GroupTable, or_tables

# Eight workers, two coordinators of four; group 0 = {0,1,2,3} (the paper's
# example of an expected vector), group 1 spans both coordinators.
TABLE = GroupTable(groups=((0, 1, 2, 3), (2, 5), (4, 5, 6, 7)), width=8)


def pair() -> tuple[Coordinator, Coordinator]:
    return Coordinator(TABLE, range(4)), Coordinator(TABLE, range(4, 8))


def align(*coords: Coordinator):
    merged = or_tables([c.begin_round() for c in coords])
    return [c.finish_round(merged) for c in coords]


def test_expected_vector_has_exactly_the_members_bits():
    assert TABLE.expected[0] == 0b00001111
    assert TABLE.expected[1] == (1 << 2) | (1 << 5)


def test_group_is_ready_only_when_every_member_registered():
    a, b = pair()
    for w in (0, 1, 2):
        a.register(w, 0)
    assert align(a, b) == [(), ()]
    a.register(3, 0)
    launches_a, launches_b = align(a, b)
    assert [(l.group, l.seq, l.local) for l in launches_a] == [(0, 0, (0, 1, 2, 3))]
    assert launches_b == ()
    assert not a.pending_groups()


def test_ready_groups_launch_in_ascending_group_order_on_every_coordinator():
    a, b = pair()
    for w in (4, 5, 6, 7):
        b.register(w, 2)
    b.register(5, 1)
    a.register(2, 1)
    for w in (0, 1, 3):
        a.register(w, 0)
    a.register(2, 0)
    launches_a, launches_b = align(a, b)
    assert [l.group for l in launches_a] == [0, 1]
    assert [l.group for l in launches_b] == [1, 2]


def test_sequence_numbers_count_launches_per_group():
    a, b = pair()
    for _ in range(3):
        a.register(2, 1)
        b.register(5, 1)
        align(a, b)
    assert [l.seq for l in a.launched] == [0, 1, 2]


@pytest.mark.parametrize("call, message", [
    (lambda c: c.register(5, 1), "not served"),
    (lambda c: c.register(0, 1), "not a member"),
    (lambda c: c.register(0, 9), "no group"),
    (lambda c: c.finish_round((0, 0, 0)), "without begin_round"),
])
def test_illegal_transitions_raise_and_leave_state_unchanged(call, message):
    a, _ = pair()
    a.register(2, 1)
    before = copy.deepcopy(a.__dict__)
    with pytest.raises(CoordinatorError, match=message):
        call(a)
    assert a.__dict__ == before


def test_double_registration_on_one_group_is_refused():
    a, _ = pair()
    a.register(0, 0)
    with pytest.raises(CoordinatorError, match="already waits"):
        a.register(0, 0)
    assert a.registered(0, 0)


def test_inconsistent_merged_table_is_refused_and_round_stays_open():
    a, _ = pair()
    a.register(2, 1)
    a.begin_round()
    before = copy.deepcopy(a.__dict__)
    for bad in [(0, 0, 0), (0, 1 << 2 | 1 << 3, 0), (0,)]:  # lost bit, non-member, length
        with pytest.raises(CoordinatorError):
            a.finish_round(bad)
        assert a.__dict__ == before
    with pytest.raises(CoordinatorError, match="already in progress"):
        a.begin_round()


def test_registration_after_a_snapshot_waits_for_the_next_round():
    a, b = pair()
    a.register(2, 1)
    snapshots = [a.begin_round(), b.begin_round()]
    b.register(5, 1)  # b's table is already frozen for this round
    merged = or_tables(snapshots)
    assert a.finish_round(merged) == () and b.finish_round(merged) == ()
    launches_a, launches_b = align(a, b)
    assert [l.group for l in launches_a] == [1] and [l.group for l in launches_b] == [1]


def test_requests_on_one_group_register_one_at_a_time_in_order():
    """A worker's second send on a pair waits behind the first: only the
    head is registered, the next registers when the head is launched."""
    a, b = pair()
    ra, rb = Requests[str](a), Requests[str](b)
    ra.post(2, 1, "first")
    ra.post(2, 1, "second")
    assert a.registered(2, 1) and ra.outstanding() == 2
    rb.post(5, 1, "peer-1")
    la, lb = align(a, b)
    assert ra.take(la[0]) == ("first",) and rb.take(lb[0]) == ("peer-1",)
    assert a.registered(2, 1) and not b.registered(5, 1)  # "second" is next in line
    rb.post(5, 1, "peer-2")
    la, lb = align(a, b)
    assert ra.take(la[0]) == ("second",) and ra.outstanding() == 0


def test_control_thread_runs_ready_groups_in_ascending_order_then_stops():
    a = Coordinator(TABLE, range(8))
    requests = Requests[int](a)
    for w in (4, 5, 6, 7):  # group 2 is posted first, group 1 after it
        requests.post(w, 2, w)
    for w in (2, 5):
        requests.post(w, 1, w)
    program = control_thread(requests, lambda: False, nap_s=0.5)
    align_op = next(program)
    assert isinstance(align_op, Align) and align_op.active
    ops = [program.send(Aligned(align_op.table, True))]
    ops += [program.send(None) for _ in range(2)]
    assert [(op.launch.group, op.requests) for op in ops[:2]] == [(1, (2, 5)), (2, (4, 5, 6, 7))]
    assert isinstance(ops[2], Align) and not ops[2].active  # ran something: no nap
    assert isinstance(program.send(Aligned((0, 0, 0), True)), Nap)
    final = program.send(None)
    with pytest.raises(StopIteration):
        program.send(Aligned(final.table, False))
