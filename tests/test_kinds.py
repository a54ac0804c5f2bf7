"""One trace-args contract (``ops.trace_args``) and one event classifier
(``megatronapp.trace.kinds``), with fallbacks for older and foreign traces."""
from __future__ import annotations

from typing import Any

import pytest

from megatronapp.trace.kinds import event_kind, p2p_side
from megatronapp.parallel.ops import AllReduce, Compute, IRecv, ISend, Recv, Send, encode_tag, trace_args
from megatronapp.scan.ingest.deps import reconstruct
from megatronapp.trace.events import Event, chrome_events
from sim import run_sim

from .support import fixed_cost_scenario

META = {"iteration": 1, "microbatch": 2, "chunk": 0}


@pytest.mark.parametrize("op, expected", [
    (Compute("forward", 1.0, meta=META), {**META, "kind": "compute"}),
    (Send(dst=3, tag=("F", 2, 1), nbytes=64, name="send_forward", meta=META),
     {**META, "kind": "p2p", "role": "send", "peer": 3, "tag": encode_tag(("F", 2, 1)),
      "bytes": 64}),
    (IRecv(src=5, tag="t", nbytes=8), {"kind": "p2p", "role": "recv", "peer": 5,
                                        "tag": encode_tag("t"), "bytes": 8}),
    (AllReduce(group=(0, 4), nbytes=16, meta=META),
     {**META, "kind": "collective", "group": [0, 4], "bytes": 16}),
])
def test_trace_args_of_each_op_kind(op: Any, expected: dict[str, Any]) -> None:
    assert trace_args(op) == expected
    assert event_kind(op.name, trace_args(op)) == op.kind


def test_backends_may_record_the_real_size() -> None:
    assert trace_args(ISend(dst=1, tag=0, nbytes=10), nbytes=12)["bytes"] == 12


def test_a_simulated_trace_records_every_ops_kind_and_its_chrome_category() -> None:
    s = fixed_cost_scenario(parallel={"tp": 2, "pp": 2, "dp": 2, "microbatches": 2},
                            model={"layers": 4})
    events = run_sim(s).events
    kinds = {e.args["kind"] for ev in events.values() for e in ev}
    assert kinds == {"compute", "p2p", "collective"}
    for rank, ev in events.items():
        for chrome in chrome_events(rank, "r", ev, lambda t: t)[5:]:
            assert chrome["cat"] == chrome["args"]["kind"]


def _strip(events: dict[int, list[Event]], keys: tuple[str, ...]) -> dict[int, list[Event]]:
    return {r: [Event(e.name, e.start_s, e.dur_s, {k: v for k, v in e.args.items()
                                                    if k not in keys}) for e in ev]
            for r, ev in events.items()}


def test_a_trace_written_before_kinds_were_recorded_links_the_same_sync_ops() -> None:
    """Older traces have no kind, role or tag: kinds come from their group and
    peer args, p2p pairs from the names' direction (send_forward <-> recv_forward)."""
    s = fixed_cost_scenario(schedule="interleaved",
                            parallel={"tp": 2, "pp": 2, "dp": 2, "vpp": 2, "microbatches": 4},
                            model={"layers": 8})
    events = run_sim(s).events
    legacy = _strip(events, ("kind", "role", "tag"))

    def members(ops: list[Any]) -> set[tuple[str, tuple[Any, ...]]]:
        return {(op.kind, op.members) for op in ops}

    new_ops, old_ops = reconstruct(events), reconstruct(legacy)
    assert len(new_ops) > 0 and members(new_ops) == members(old_ops)
    for ev, old in zip(events.values(), legacy.values()):
        assert [e.args["kind"] for e in ev] == [event_kind(e.name, e.args) for e in old]


@pytest.mark.parametrize("name, cat, kind", [
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", "collective"),
    ("c10d::allreduce_", "cpu_op", "collective"),
    ("gloo:all_reduce", "user_annotation", "collective"),
    ("c10d::recv_", "cpu_op", "p2p"),
    ("gloo:send", "user_annotation", "p2p"),
    ("ampere_sgemm_128x64_tn", "kernel", "compute"),
    ("aten::mm", "kernel", "compute"),
    ("forward", None, "compute"),
    ("ProfilerStep#3", "user_annotation", "other"),
])
def test_foreign_events_are_classified_by_name(name: str, cat: str | None, kind: str) -> None:
    assert event_kind(name, {}, cat) == kind


def test_a_recorded_kind_wins_over_the_name() -> None:
    assert event_kind("send_forward_stats", {"kind": "compute"}) == "compute"
    assert event_kind("my_op", {"kind": "nonsense", "peer": 2}) == "p2p"


def test_p2p_side_prefers_the_recorded_role_and_tag() -> None:
    assert p2p_side("xfer", {"peer": 1, "role": "recv", "tag": 9}) == ("recv", ("tag", 9))
    assert p2p_side("send_backward", {"peer": 1}) == ("send", ("name", "backward"))
    assert p2p_side("send_backward", {}) is None
