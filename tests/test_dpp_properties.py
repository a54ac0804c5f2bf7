"""Property tests: random pipelines, memory caps and jitter under the adaptive schedule."""
from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatronapp.scenario.config import Scenario, parse_scenario
from megatronapp.costs.per_op import stage_costs
from megatronapp.dpp.memory import MemoryModel, trace_peak_slots
from megatronapp.program.layout import pipe_shape, topology_of
from megatronapp.trace.events import Event
from sim import run_sim


@st.composite
def scenarios(draw: Any) -> tuple[Scenario, int]:
    pp, vpp = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    m = draw(st.integers(1, 8))
    data = {
        "seed": draw(st.integers(0, 10_000)), "iterations": draw(st.integers(1, 2)),
        "schedule": "adaptive",
        "parallel": {"pp": pp, "vpp": vpp, "microbatches": m, "dp": draw(st.integers(1, 2))},
        "model": {"layers": pp * vpp, "hidden": 256, "heads": 4, "seq_len": 256, "vocab": 1024},
        "cluster": {"gpus_per_node": draw(st.sampled_from([1, 2, 8])),
                    "jitter": {"compute_sigma": draw(st.floats(0, 0.5)),
                               "link_sigma": draw(st.floats(0, 1.5))}},
        "dpp": {"traversal": draw(st.sampled_from(["breadth", "depth"])),
                "max_pending_sends": draw(st.integers(1, 4))},
    }
    # Memory for between vpp (the least the adaptive schedule accepts) and all slots.
    s = parse_scenario(data)
    memory = MemoryModel.of(s, stage_costs(s), pipe_shape(s))
    slots = draw(st.integers(vpp, m * vpp + 1))
    data["cluster"]["gpu"] = {"memory_gb": memory.bytes_for(slots) / 1e9 + memory.slot_bytes / 2e9}
    return parse_scenario(data), slots


def stage_key(s: Scenario, rank: int, e: Event) -> tuple:
    topo, shape = topology_of(s), pipe_shape(s)
    c = topo.coord(rank)
    vs = shape.virtual_stage(c.pp, e.args["chunk"])
    return (c.dp, c.tp, e.args["iteration"], e.name, e.args["microbatch"], vs)


def check_dependencies(s: Scenario, events: dict[int, list[Event]]) -> None:
    spans = {}
    for rank, rank_events in events.items():
        for e in rank_events:
            if e.name in ("forward", "backward"):
                spans[stage_key(s, rank, e)] = (e.start_s, e.end_s)
    last = pipe_shape(s).num_virtual_stages - 1
    eps = 1e-12
    for (dp, tp, it, name, mb, vs), (start, _end) in spans.items():
        needs = []
        if name == "forward" and vs > 0:
            needs.append((dp, tp, it, "forward", mb, vs - 1))
        if name == "backward":
            needs.append((dp, tp, it, "forward", mb, vs))
            if vs < last:
                needs.append((dp, tp, it, "backward", mb, vs + 1))
        for need in needs:
            assert spans[need][1] <= start + eps, f"{name} {mb} at stage {vs} ran before {need}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_adaptive_runs_every_task_once_in_dependency_order_within_memory(case) -> None:
    s, slots = case
    events = run_sim(s).events  # raises SimDeadlock if any rank could not finish
    shape = pipe_shape(s)
    expected = Counter((it, ph, mb, c) for it in range(s.iterations) for ph in ("forward", "backward")
                       for mb in range(shape.microbatches) for c in range(shape.vpp))
    for rank, rank_events in events.items():
        ran = Counter((e.args["iteration"], e.name, e.args["microbatch"], e.args["chunk"])
                      for e in rank_events if e.name in ("forward", "backward"))
        assert ran == expected, f"rank {rank} lost or repeated a task"
        assert trace_peak_slots(rank_events) <= slots, f"rank {rank} exceeded its memory"
    check_dependencies(s, events)


def test_adaptive_finishes_with_the_least_memory_it_accepts() -> None:
    # Memory for exactly vpp slots: every rank can hold only one microbatch.
    # (A reserve of only the head's missing forwards deadlocked here.)
    for pp, vpp, m in ((1, 3, 3), (4, 2, 8), (3, 3, 5)):
        data = {"schedule": "adaptive", "parallel": {"pp": pp, "vpp": vpp, "microbatches": m},
                "model": {"layers": pp * vpp, "hidden": 256, "heads": 4, "seq_len": 256,
                          "vocab": 1024}}
        s = parse_scenario(data)
        memory = MemoryModel.of(s, stage_costs(s), pipe_shape(s))
        data["cluster"] = {"gpu": {"memory_gb": (memory.bytes_for(vpp) + memory.slot_bytes / 2) / 1e9}}
        events = run_sim(parse_scenario(data)).events
        assert max(trace_peak_slots(ev) for ev in events.values()) == vpp
