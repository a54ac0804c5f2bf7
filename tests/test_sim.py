"""The SimPy backend: closed forms, the ring all-reduce formula, and properties."""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatronapp.scenario.config import Scenario, parse_scenario
from megatronapp.program.layout import pipe_shape, topology_of
from megatronapp.parallel.ops import AllReduce, ISend, Recv, Wait
from megatronapp.scan.evidence.critical import critical_path
from megatronapp.scan.ingest.deps import reconstruct
from megatronapp.trace.summary import iteration_spans, summarize
from megatronapp.trace.events import Event
from sim import SimDeadlock, run_sim
from sim.cluster import build_cluster
from sim.interpreter import SimInterpreter
from sim.network import gbps_to_bytes_per_s

from .support import fixed_cost_scenario

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------ closed forms
@FAST
@given(schedule=st.sampled_from(["gpipe", "1f1b"]), p=st.integers(1, 6), m=st.integers(1, 12),
       f=st.floats(0.1, 5.0), b=st.floats(0.1, 5.0))
def test_gpipe_and_1f1b_match_closed_form(schedule: str, p: int, m: int, f: float,
                                          b: float) -> None:
    s = fixed_cost_scenario(schedule=schedule, parallel={"pp": p, "microbatches": m},
                            model={"layers": 60}, costs={"forward_s": f, "backward_s": b})
    summary = summarize(run_sim(s).events)
    assert summary["iteration_times_s"] == [pytest.approx((m + p - 1) * (f + b), rel=1e-12)]
    assert summary["bubble_fraction"] == pytest.approx((p - 1) / (m + p - 1), rel=1e-9, abs=1e-12)


@FAST
@given(p=st.integers(2, 5), v=st.integers(2, 4), groups=st.integers(1, 4),
       f=st.floats(0.1, 5.0), b=st.floats(0.1, 5.0))
def test_interleaved_matches_closed_form(p: int, v: int, groups: int, f: float, b: float) -> None:
    m = p * groups
    s = fixed_cost_scenario(schedule="interleaved", parallel={"pp": p, "vpp": v, "microbatches": m},
                            model={"layers": p * v * 2}, costs={"forward_s": f, "backward_s": b})
    summary = summarize(run_sim(s).events)
    expected = (f + b) * (m + (p - 1) / v)
    assert summary["iteration_times_s"] == [pytest.approx(expected, rel=1e-12)]
    assert summary["bubble_fraction"] == pytest.approx((p - 1) / v / (m + (p - 1) / v), rel=1e-9)


# -------------------------------------------------------- ring all-reduce
def _allreduce_time(s: Scenario, group: tuple[int, ...], nbytes: int) -> float:
    cluster = build_cluster(s)

    def program(rank: int):
        if rank in group:
            yield AllReduce(group=group, nbytes=nbytes)

    events = SimInterpreter(cluster).run({r: program(r) for r in range(s.world_size)})
    (event,) = events[group[0]]
    return event.dur_s


@pytest.mark.parametrize("n,gpus_per_node", [(2, 8), (4, 8), (8, 8), (8, 2), (5, 1)])
@pytest.mark.parametrize("nbytes", [1, 10**6, 3 * 10**8])
def test_ring_allreduce_alpha_beta(n: int, gpus_per_node: int, nbytes: int) -> None:
    s = parse_scenario({"parallel": {"dp": n}, "cluster": {
        "gpus_per_node": gpus_per_node,
        "links": {"intra_node_gbps": 1000, "inter_node_gbps": 200, "latency_us": 7}}})
    bw = gbps_to_bytes_per_s(1000 if gpus_per_node >= n else 200)
    alpha = 7e-6
    per_node, nodes = min(n, gpus_per_node), -(-n // gpus_per_node)
    steps = (per_node - 1) + (nodes - 1)  # NVLink steps, then one per further node
    expected = 2 * (n - 1) / n * nbytes / bw + 2 * steps * alpha
    assert _allreduce_time(s, tuple(range(n)), nbytes) == pytest.approx(expected, rel=1e-12)


def test_slow_link_slows_the_ring() -> None:
    base = {"parallel": {"dp": 4}, "cluster": {"links": {"latency_us": 0}}}
    healthy = _allreduce_time(parse_scenario(base), (0, 1, 2, 3), 10**8)
    slow = parse_scenario({**base, "faults": [{"kind": "slow_link", "ranks": [2, 3], "factor": 3}]})
    assert _allreduce_time(slow, (0, 1, 2, 3), 10**8) == pytest.approx(3 * healthy)


def test_a_slow_links_window_slows_only_the_collectives_starting_inside_it() -> None:
    base = {"parallel": {"dp": 4}, "cluster": {"links": {"latency_us": 0}}}
    group, nbytes = (0, 1, 2, 3), 10**8
    healthy = _allreduce_time(parse_scenario(base), group, nbytes)
    timed = parse_scenario({**base, "faults": [
        {"kind": "slow_link", "ranks": [2, 3], "factor": 3, "start_s": 1.0, "end_s": 2.0}]})
    ring = build_cluster(timed).network.ring(group)  # what the compiled engine prices
    assert [ring.seconds(nbytes, 2, at) / healthy for at in (0.0, 0.99, 1.0, 1.5, 2.0)] == \
        pytest.approx([1, 1, 3, 3, 1])


def _link_run(faults: str) -> Any:
    from pathlib import Path

    from megatronapp.scenario.config import load_scenario
    from megatronapp.trace.columns import concat_same, source_of
    from sim import simulate

    s = load_scenario(Path(__file__).resolve().parents[1] / "scenarios/throttle.yaml",
                      ["iterations=4", f"faults={faults}",
                       "cluster.jitter={compute_sigma: 0, link_sigma: 0}"])
    return concat_same(list(source_of(simulate(s)).batches()))


def test_a_slow_link_with_an_onset_is_slow_from_then_on_in_the_compiled_engine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object, **_kw: object) -> None:
        raise AssertionError("the SimPy interpreter ran")

    monkeypatch.setattr(SimInterpreter, "__init__", refuse)
    onset, src, dst = 0.2, 5, 9  # about half-way through scenarios/throttle.yaml's 4 iterations
    healthy = _link_run("[]")
    slow = _link_run(f"[{{kind: slow_link, ranks: [{src}, {dst}], factor: 3, start_s: {onset}}}]")
    before = healthy.start_s < onset
    assert before.any() and (~before).any()
    # nothing before the onset changes; after it, every send on the link is slower
    early = slow.start_s < onset
    assert early.sum() == before.sum()
    for field in ("rank", "name", "start_s", "dur_s"):
        assert (getattr(slow, field)[early] == getattr(healthy, field)[before]).all()
    sends = [(c, (c.rank == src) & (c.peer == dst) & (c.name == c.names.index("send_forward")))
             for c in (healthy, slow)]
    (h, h_sends), (f, f_sends) = sends
    late = f_sends & (f.start_s >= onset)
    assert late.any()
    assert f.dur_s[late].min() > 2 * h.dur_s[h_sends].max()
    assert (f.dur_s[f_sends & ~late] == h.dur_s[h_sends & (h.start_s < onset)]).all()


# ------------------------------------------------------- bandwidth sharing
def _send_times(dsts: list[int], nbytes: int) -> dict[int, float]:
    s = parse_scenario({"parallel": {"dp": 4}, "cluster": {"links": {"latency_us": 0}}})
    cluster = build_cluster(s)

    def sender():
        handles = []
        for d in dsts:
            handles.append((yield ISend(dst=d, tag=("x", d), nbytes=nbytes)))
        for h in handles:
            yield Wait(h)

    def receiver(rank: int):
        if rank in dsts:
            yield Recv(src=0, tag=("x", rank), nbytes=nbytes)

    programs = {0: sender(), **{r: receiver(r) for r in (1, 2, 3)}}
    events = SimInterpreter(cluster).run(programs)
    return {e.args["peer"]: e.dur_s for e in events[0]}


def test_transfers_sharing_a_port_share_its_bandwidth() -> None:
    alone = _send_times([1], 10**9)[1]
    shared = _send_times([1, 2], 10**9)
    assert shared[1] == pytest.approx(2 * alone) and shared[2] == pytest.approx(2 * alone)


def test_deadlock_is_reported_with_the_blocked_ranks() -> None:
    s = parse_scenario({"parallel": {"dp": 2}})

    def waits_forever(rank: int):
        yield Recv(src=1 - rank, tag="never", nbytes=4)

    with pytest.raises(SimDeadlock, match="rank 0 on Recv"):
        SimInterpreter(build_cluster(s)).run({r: waits_forever(r) for r in (0, 1)})


# ------------------------------------------------------------- properties
@st.composite
def scenarios(draw: Any, faults: bool = True) -> dict[str, Any]:
    tp, pp, dp = draw(st.sampled_from([1, 2])), draw(st.integers(1, 4)), draw(st.sampled_from([1, 2]))
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved"]))
    vpp = draw(st.sampled_from([1, 2])) if schedule == "interleaved" and pp > 1 else 1
    m = pp * draw(st.integers(1, 3))
    world = tp * pp * dp
    data: dict[str, Any] = {
        "seed": draw(st.integers(0, 1000)), "iterations": draw(st.integers(1, 2)),
        "schedule": schedule,
        "parallel": {"tp": tp, "pp": pp, "dp": dp, "vpp": vpp, "microbatches": m},
        "model": {"layers": 2 * pp * vpp, "hidden": 256, "heads": 4, "seq_len": 128, "vocab": 1024},
        "cluster": {"gpus_per_node": draw(st.sampled_from([2, 4, 8])),
                    "jitter": {"compute_sigma": draw(st.sampled_from([0.0, 0.05])),
                               "link_sigma": draw(st.sampled_from([0.0, 0.2]))}},
        "faults": [],
        "allow_idle_faults": True,  # a random pair: the properties hold for any link
    }
    if faults and world > 1 and draw(st.booleans()):
        a = draw(st.integers(0, world - 1))
        b = draw(st.integers(0, world - 1).filter(lambda r: r != a))
        data["faults"] = [draw(st.sampled_from([
            {"kind": "throttle", "rank": a, "factor": 1.7},
            {"kind": "slow_link", "ranks": [a, b], "factor": 4.0},
            {"kind": "link_jitter", "ranks": [a, b], "sigma": 0.5},
            {"kind": "clock_skew", "rank": a, "offset_us": 900.0, "drift_ppm": 50.0}]))]
    return data


def _flatten(events: dict[int, list[Event]]) -> list[tuple]:
    return [(r, e.name, e.start_s, e.dur_s, tuple(sorted((k, str(v)) for k, v in e.args.items())))
            for r in sorted(events) for e in events[r]]


@FAST
@given(data=scenarios())
def test_same_seed_gives_identical_trace(data: dict[str, Any]) -> None:
    s = parse_scenario(data)
    assert _flatten(run_sim(s).events) == _flatten(run_sim(s).events)


@FAST
@given(data=scenarios(faults=False), draw=st.data(), factor=st.floats(1.01, 4.0))
def test_slowing_a_device_or_link_never_makes_an_iteration_end_earlier(
        data: dict[str, Any], draw: st.DataObject, factor: float) -> None:
    """Completion times are monotone in every duration. (An iteration's own
    span is not: a delay to its start can exceed the delay to its end.)"""
    base = parse_scenario(data)
    world = base.world_size
    a = draw.draw(st.integers(0, world - 1), label="rank")
    if world > 1 and draw.draw(st.booleans(), label="slow a link instead"):
        b = draw.draw(st.integers(0, world - 1).filter(lambda r: r != a), label="peer")
        fault = {"kind": "slow_link", "ranks": [a, b], "factor": factor}
    else:
        fault = {"kind": "throttle", "rank": a, "factor": factor}
    slowed = parse_scenario({**data, "faults": [fault]})
    before = iteration_spans(run_sim(base).events)
    after = iteration_spans(run_sim(slowed).events)
    assert after.keys() == before.keys()
    for it, (_, end) in before.items():
        assert after[it][1] >= end * (1 - 1e-12)


@FAST
@given(data=scenarios())
def test_critical_path_accounts_for_the_whole_run(data: dict[str, Any]) -> None:
    """The simulator never waits for nothing: the longest chain of work through
    the trace's dependency graph (program order, send -> receive, collectives)
    spans the whole run, and a rank never runs two computations at once."""
    events = run_sim(parse_scenario(data)).events
    path = critical_path(events, reconstruct(events))
    assert path.length_s == pytest.approx(path.window_s, rel=1e-9)
    for rank_events in events.values():
        compute = sorted((e.start_s, e.end_s) for e in rank_events if e.args["kind"] == "compute")
        for (_, end), (start, _) in zip(compute, compute[1:]):
            assert start >= end - 1e-12, "a rank ran two computations at once"


@FAST
@given(data=scenarios())
def test_every_send_meets_its_recv(data: dict[str, Any]) -> None:
    events = run_sim(parse_scenario(data)).events
    sends: dict[tuple, list[Event]] = defaultdict(list)
    recvs: dict[tuple, list[Event]] = defaultdict(list)
    for rank, rank_events in events.items():
        for e in rank_events:
            if e.name.startswith(("send_", "recv_")):
                direction = e.name.split("_")[1]
                src, dst = (rank, e.args["peer"]) if e.name.startswith("send") else (e.args["peer"], rank)
                key = (src, dst, direction, e.args["iteration"], e.args["microbatch"])
                (sends if e.name.startswith("send") else recvs)[key].append(e)
    assert sends.keys() == recvs.keys()
    for key, sent in sends.items():
        assert len(sent) == len(recvs[key])
        assert max(e.end_s for e in recvs[key]) >= max(e.end_s for e in sent) - 1e-12


def _compute_index(events: dict[int, list[Event]]) -> dict[tuple, Event]:
    return {(r, e.name, e.args["iteration"], e.args["microbatch"], e.args["chunk"]): e
            for r, evs in events.items() for e in evs if e.name in ("forward", "backward")}


@FAST
@given(data=scenarios())
def test_no_op_starts_before_its_dependencies_end(data: dict[str, Any]) -> None:
    s = parse_scenario(data)
    events = run_sim(s).events
    topo, shape = topology_of(s), pipe_shape(s)
    index = _compute_index(events)
    for (rank, name, it, mb, chunk), e in index.items():
        vs = shape.virtual_stage(topo.coord(rank).pp, chunk)
        deps = []
        up = vs - 1 if name == "forward" else vs + 1
        if 0 <= up < shape.num_virtual_stages:
            up_pp, up_chunk = shape.locate(up)
            up_rank = topo.pp_neighbor(rank, up_pp - topo.coord(rank).pp)
            deps.append(index[(up_rank, name, it, mb, up_chunk)])
        if name == "backward":
            deps.append(index[(rank, "forward", it, mb, chunk)])
        for d in deps:
            assert e.start_s >= d.end_s - 1e-12
    # a collective ends only after every member has arrived
    collectives: dict[tuple, list[Event]] = defaultdict(list)
    for rank, rank_events in events.items():
        seen: dict[tuple, int] = defaultdict(int)
        for e in rank_events:
            if "group" in e.args:
                g = tuple(e.args["group"])
                collectives[(g, seen[g])].append(e)
                seen[g] += 1
    for members in collectives.values():
        assert min(m.end_s for m in members) >= max(m.start_s for m in members) - 1e-12
