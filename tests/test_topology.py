import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core.parallel_state import RankGenerator

from megatronapp.parallel.topology import Topology

from .support import run_cli

sizes = st.integers(min_value=1, max_value=4)


@settings(max_examples=40, deadline=None)
@given(tp=sizes, pp=sizes, dp=sizes)
def test_groups_match_megatron_rank_generator(tp: int, pp: int, dp: int) -> None:
    ours = Topology(tp=tp, pp=pp, dp=dp)
    theirs = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for kind, groups in ours.groups_json().items():
        assert sorted(groups) == sorted(theirs.get_ranks(kind))
    assert sorted(map(list, ours.model_parallel_groups)) == sorted(theirs.get_ranks("tp-pp"))


@settings(max_examples=40, deadline=None)
@given(tp=sizes, pp=sizes, dp=sizes)
def test_coord_round_trip_and_group_membership(tp: int, pp: int, dp: int) -> None:
    topo = Topology(tp=tp, pp=pp, dp=dp)
    for rank in range(topo.world_size):
        c = topo.coord(rank)
        assert topo.rank(c.dp, c.pp, c.tp) == rank
        assert rank in topo.tp_group(rank) and rank in topo.dp_group(rank)
        assert topo.pp_group(rank)[c.pp] == rank
        assert topo.stage(rank) == c.pp


def test_out_of_range_rank_is_rejected() -> None:
    with pytest.raises(ValueError, match="out of range"):
        Topology(tp=2, pp=2).coord(4)


def test_cli_prints_groups_as_json() -> None:
    out = run_cli("topology", "--tp", "2", "--pp", "2", "--dp", "2", "--json")
    assert out.returncode == 0, out.stderr
    expected = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    got = json.loads(out.stdout)
    assert got["tp"] == expected.get_ranks("tp")
    assert got["dp"] == expected.get_ranks("dp")
    assert got["pp"] == expected.get_ranks("pp")


def test_cli_rejects_zero_size() -> None:
    out = run_cli("topology", "--tp", "0")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "--tp" in out.stderr
