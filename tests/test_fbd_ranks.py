"""Virtual/physical rank mapping of MegaFBD."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from megatronapp.fbd.ranks import FbdLayout, Worker, collective_groups
from megatronapp.topology import Topology


@st.composite
def layouts(draw):
    tp, pp, dp = (draw(st.sampled_from([1, 2, 4])) for _ in range(3))
    forward_tp = draw(st.sampled_from([d for d in (1, 2, 4) if tp % d == 0]))
    colocated = draw(st.booleans())
    return FbdLayout(Topology(tp=tp, pp=pp, dp=dp), forward_tp=tp if colocated else forward_tp,
                     backward_tp=tp, colocated=colocated)


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_devices_partition_the_workers_and_follow_megatron_order(layout):
    placed = [w for ws in layout.workers_by_device.values() for w in ws]
    assert sorted(placed) == list(range(layout.num_workers))
    for device, workers in layout.workers_by_device.items():
        phases = {layout.worker(w).phase for w in workers}
        if layout.colocated:
            assert phases == {"F", "B"} and len(workers) == 2
            continue
        (phase,) = phases
        assert len(workers) == layout.threads_per_device(phase)
        vranks = [layout.worker(w).vrank for w in workers]
        # threads on one device are TP shards of one (dp, pp) slice
        assert set(vranks) <= set(layout.topo.tp_group(vranks[0]))
        reduced = Topology(tp=layout.forward_tp if phase == "F" else layout.backward_tp,
                           pp=layout.topo.pp, dp=layout.topo.dp)
        c = layout.topo.coord(vranks[0])
        offset = 0 if phase == "F" else layout.forward_devices
        assert device == offset + reduced.rank(c.dp, c.pp, c.tp // len(workers))


def test_paper_figure_two_forward_packed_backward_spread():
    layout = FbdLayout(Topology(tp=2), forward_tp=1, backward_tp=2)
    assert layout.num_devices == 3
    assert layout.workers_by_device == {0: (0, 1), 1: (2,), 2: (3,)}
    assert layout.same_device(Worker("F", 0), Worker("F", 1))
    assert not layout.crosses_devices((0, 1)) and layout.crosses_devices((2, 3))


def test_colocated_puts_both_workers_of_a_virtual_rank_together():
    layout = FbdLayout(Topology(tp=2, pp=2), forward_tp=2, backward_tp=2, colocated=True)
    for v in range(4):
        assert layout.device_of(Worker("F", v)) == layout.device_of(Worker("B", v)) == v


def test_worker_ids_round_trip():
    layout = FbdLayout(Topology(tp=2, pp=2, dp=2), forward_tp=1, backward_tp=2)
    for wid in range(layout.num_workers):
        assert layout.worker_id(layout.worker(wid)) == wid
    with pytest.raises(ValueError):
        layout.worker(layout.num_workers)


@pytest.mark.parametrize("forward_tp, backward_tp, colocated", [(3, 4, False), (4, 8, False),
                                                                 (2, 4, True)])
def test_bad_degrees_are_refused(forward_tp, backward_tp, colocated):
    with pytest.raises(ValueError):
        FbdLayout(Topology(tp=4), forward_tp=forward_tp, backward_tp=backward_tp,
                  colocated=colocated)


def test_only_cross_device_groups_reach_the_coordinator():
    packed = FbdLayout(Topology(tp=2, dp=2), forward_tp=1, backward_tp=2)
    groups = collective_groups(packed)
    n = packed.virtual_ranks
    assert all(min(g) >= n for g in groups)  # forward TP shards share a device
    assert set(groups) == {tuple(v + n for v in g)
                           for g in packed.topo.tp_groups + packed.topo.dp_groups}
    spread = FbdLayout(Topology(tp=2, dp=2), forward_tp=2, backward_tp=2)
    assert set(packed.topo.tp_groups) <= set(collective_groups(spread))
