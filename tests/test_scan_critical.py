"""The cross-rank dependency graph and its critical path."""
from __future__ import annotations

from typing import Any

import networkx as nx
import pytest

from megatronapp.scan.evidence.critical import critical_path, dependency_graph
from megatronapp.scan.ingest.deps import reconstruct
from megatronapp.scan.ingest.load import events_from_chrome
from sim import run_sim

from .support import fixed_cost_scenario

LEGACY_KEYS = ("kind", "role", "tag")


def _x(rank: int, name: str, start_ms: float, end_ms: float, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "name": name, "pid": rank, "tid": 0, "ts": start_ms * 1e3,
            "dur": (end_ms - start_ms) * 1e3, "args": args}


# Three ranks; the longest chain of work is rank 0's forward, its send to rank
# 1, rank 1's long forward, the all-reduce it arrives last at, rank 2's step.
HAND_BUILT = [
    _x(0, "forward", 0, 2, kind="compute"),
    _x(0, "send_forward", 2, 3, kind="p2p", role="send", peer=1, tag=7, bytes=100),
    _x(0, "backward", 3, 4, kind="compute"),
    _x(1, "recv_forward", 0.5, 3, kind="p2p", role="recv", peer=0, tag=7, bytes=100),
    _x(1, "forward", 3, 8, kind="compute"),
    _x(1, "dp_allreduce", 8, 9.5, kind="collective", group=[1, 2], bytes=8),
    _x(2, "forward", 0, 6, kind="compute"),
    _x(2, "dp_allreduce", 6, 9.5, kind="collective", group=[1, 2], bytes=8),
    _x(2, "optimizer", 9.5, 10, kind="compute"),
]
EXPECTED_PATH = [(0, "forward", 2.0), (0, "send_forward", 1.0), (1, "forward", 5.0),
                 (2, "dp_allreduce", 1.5), (2, "optimizer", 0.5)]


def _legacy(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same trace as written before events recorded their kind."""
    return [{**e, "args": {k: v for k, v in e["args"].items() if k not in LEGACY_KEYS}}
            for e in raw]


@pytest.mark.parametrize("raw", [HAND_BUILT, _legacy(HAND_BUILT)], ids=["kinds", "legacy"])
def test_hand_built_trace_has_the_known_critical_path(raw: list[dict[str, Any]]) -> None:
    events = events_from_chrome(raw)
    path = critical_path(events, reconstruct(events))
    assert [(s.rank, s.name, pytest.approx(s.seconds * 1e3)) for s in path.steps] == EXPECTED_PATH
    assert path.length_s == pytest.approx(10e-3) == path.window_s
    assert path.by_rank() == {1: pytest.approx(5e-3), 0: pytest.approx(3e-3),
                              2: pytest.approx(2e-3)}
    assert path.by_kind() == {"compute": pytest.approx(7.5e-3), "collective": pytest.approx(1.5e-3),
                              "p2p": pytest.approx(1e-3)}


def test_graph_links_ranks_only_through_sync_ops() -> None:
    events = events_from_chrome(HAND_BUILT)
    graph = dependency_graph(events, reconstruct(events))
    ids = graph.graph["ids"]
    assert nx.is_directed_acyclic_graph(graph)
    # rank 0's backward does not wait for anything on another rank
    ancestors = nx.ancestors(graph, ids.start(0, 2))
    assert {ids.of(n)[0] for n in ancestors if n >= 0} == {0}
    # rank 1's forward waits for rank 0's send through the receive
    assert ids.start(0, 1) in nx.ancestors(graph, ids.start(1, 1))
    # and rank 2's step for rank 1's forward, through the all-reduce
    assert ids.end(1, 1) in nx.ancestors(graph, ids.start(2, 2))


def test_a_misaligned_send_after_its_receive_adds_no_edge_back_in_time() -> None:
    raw = [_x(0, "send_forward", 5, 6, kind="p2p", role="send", peer=1, tag=1),
           _x(1, "recv_forward", 0, 1, kind="p2p", role="recv", peer=0, tag=1),
           _x(1, "forward", 1, 4, kind="compute")]
    events = events_from_chrome(raw)
    path = critical_path(events, reconstruct(events))
    assert [(s.rank, s.name) for s in path.steps] == [(1, "forward")]


def test_a_throttled_pipeline_stage_carries_the_critical_path() -> None:
    """1F1B, 4 stages, stage 2 at a third of its speed: the critical path runs
    through every one of its forwards and backwards and covers the whole run."""
    m = 6
    s = fixed_cost_scenario(parallel={"pp": 4, "microbatches": m},
                            faults=[{"kind": "throttle", "rank": 2, "factor": 3.0}])
    events = run_sim(s).events
    path = critical_path(events, reconstruct(events))
    assert path.length_s == pytest.approx(path.window_s, rel=1e-12)
    on_stage = [(st.name, st.args["microbatch"]) for st in path.steps if st.rank == 2]
    assert sorted(on_stage) == sorted((n, mb) for n in ("forward", "backward") for mb in range(m))
    assert max(path.by_rank(), key=path.by_rank().get) == 2
    assert path.by_rank()[2] > 0.8 * path.window_s
