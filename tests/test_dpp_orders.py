"""Static DFC/BFC orders against Megatron-core's own schedule table."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

from megatronapp.dpp.policies import breadth_first_traversal, depth_first_traversal, planned_order
from megatronapp.parallel.schedules import PipeShape, check_order, static_order

SHAPES = [(pp, vpp, m) for pp in (2, 3, 4) for vpp in (2, 3) for m in (pp, 2 * pp, 4 * pp)]


def megatron_warmup(pp: int, pp_rank: int, vpp: int, m: int, group: int) -> int:
    # Only the sizes and this rank's place are read from the communicator.
    comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda: pp_rank),
                           virtual_pipeline_model_parallel_size=vpp)
    return get_pp_rank_microbatches(m, vpp, group, p2p_communicator=comm)[2]


@pytest.mark.parametrize("schedule", ["dfc", "bfc"])
@pytest.mark.parametrize("pp,vpp,m", SHAPES)
def test_forward_order_and_warmup_match_megatron(schedule: str, pp: int, vpp: int, m: int) -> None:
    group = pp if schedule == "dfc" else m
    table = get_schedule_table(m, vpp, group)
    shape = PipeShape(pp, vpp, m)
    for pp_rank in range(pp):
        order = static_order(schedule, pp_rank, shape)
        check_order(order, shape)
        assert [(t.microbatch, t.chunk) for t in order if t.phase == "F"] == table
        # Backward visits the same table with chunks reversed.
        assert [(t.microbatch, vpp - 1 - t.chunk) for t in order if t.phase == "B"] == table
        first_backward = next(i for i, t in enumerate(order) if t.phase == "B")
        warmup = megatron_warmup(pp, pp_rank, vpp, m, group)
        assert first_backward == min(warmup + 1, len(order) // 2)


def test_fig3_traversals_walk_rows_or_columns_of_the_matrix() -> None:
    dfc, bfc = depth_first_traversal(8, 8), breadth_first_traversal(8, 8)
    assert sorted(dfc) == sorted(bfc) == [(mb, c) for mb in range(8) for c in range(8)]
    assert dfc[:8] == [(0, c) for c in range(8)]  # one microbatch through every chunk
    assert bfc[:8] == [(mb, 0) for mb in range(8)]  # every microbatch through one chunk


@pytest.mark.parametrize("traversal", ["breadth", "depth"])
def test_adaptive_plan_is_the_static_bfc_or_dfc_order(traversal: str) -> None:
    shape = PipeShape(4, 2, 8)
    static = "bfc" if traversal == "breadth" else "dfc"
    for r in range(4):
        assert planned_order(traversal, r, shape) == static_order(static, r, shape)
