"""Virtual/physical rank mapping of MegaFBD."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from megatronapp.fbd.ranks import FbdLayout, Worker, coordinated_groups, p2p_pairs
from megatronapp.parallel.topology import Topology


@st.composite
def layouts(draw):
    tp, pp, dp = (draw(st.sampled_from([1, 2, 4])) for _ in range(3))
    forward_tp = draw(st.sampled_from([d for d in (1, 2, 4) if tp % d == 0]))
    return FbdLayout(Topology(tp=tp, pp=pp, dp=dp), forward_tp=forward_tp, backward_tp=tp)


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_devices_partition_the_workers_and_follow_megatron_order(layout):
    placed = [w for ws in layout.workers_by_device.values() for w in ws]
    assert sorted(placed) == list(range(layout.num_workers))
    for device, workers in layout.workers_by_device.items():
        (phase,) = {layout.worker(w).phase for w in workers}
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


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_megatron_groups_over_worker_processes_hold_one_instance(layout):
    """initialize_model_parallel(tp, pp) over the 2N worker processes: tp
    fastest, then a data-parallel index of 2·dp, then pp."""
    topo = layout.topo
    ranks = [layout.process_rank(w) for w in range(layout.num_workers)]
    assert sorted(ranks) == list(range(layout.num_workers))
    wide = Topology(tp=topo.tp, pp=topo.pp, dp=2 * topo.dp)
    for w in range(layout.num_workers):
        assert layout.worker_of_process(layout.process_rank(w)) == w
    for groups in (wide.tp_groups, wide.pp_groups):
        for group in groups:
            workers = [layout.worker(layout.worker_of_process(r)) for r in group]
            assert len({x.phase for x in workers}) == 1
            # the same virtual group as in the job's own topology
            vranks = tuple(sorted(x.vrank for x in workers))
            assert vranks in set(topo.tp_groups) | set(topo.pp_groups)


def test_worker_ids_round_trip():
    layout = FbdLayout(Topology(tp=2, pp=2, dp=2), forward_tp=1, backward_tp=2)
    for wid in range(layout.num_workers):
        assert layout.worker_id(layout.worker(wid)) == wid
    with pytest.raises(ValueError):
        layout.worker(layout.num_workers)


@pytest.mark.parametrize("forward_tp, backward_tp", [(3, 4), (4, 8)])
def test_bad_degrees_are_refused(forward_tp, backward_tp):
    with pytest.raises(ValueError):
        FbdLayout(Topology(tp=4), forward_tp=forward_tp, backward_tp=backward_tp)


def test_coordinator_groups_are_cross_device_pairs_and_backward_dp_groups():
    packed = FbdLayout(Topology(tp=2, pp=2, dp=2), forward_tp=1, backward_tp=2)
    n = packed.virtual_ranks
    pairs, groups = p2p_pairs(packed), coordinated_groups(packed)
    assert groups == pairs + tuple(tuple(v + n for v in g) for g in packed.topo.dp_groups)
    assert all(packed.crosses_devices(g) for g in groups)
    # each virtual rank's forward-backward pair, and pipeline neighbours per instance
    assert {(v, v + n) for v in range(n)} <= set(pairs)
    assert len(pairs) == n + 2 * (n // 2)
    assert not set(packed.topo.tp_groups) & set(groups)  # TP runs inside the layers
