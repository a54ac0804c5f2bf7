"""The compiled engine and the symmetry reduction against the SimPy generator path.

The generator path (every rank's program in its own SimPy process) is the
reference: the compiled engine, with and without simulating one pipeline per
class of identical ones, must record the very same events with the very same
times, over random jobs and random sets of faults.
"""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from megatronapp.program.compiled import GROUP_KINDS, NotStatic, compile_pipe, pipe_ranks, record
from megatronapp.scenario.config import parse_scenario
from megatronapp.run.jobs import compile_static, rank_programs
from megatronapp.program.layout import topology_of
from megatronapp.parallel.ops import AllReduce, Recv, Send, WaitAny
from megatronapp.parallel.topology import Topology
from megatronapp.trace.events import Event
from sim import SimDeadlock, run_sim
from sim.cluster import build_cluster
from sim.engine import CompiledDeadlock, Engine, run_compiled
from sim.symmetry import identity_classes, pipe_classes

FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SCHEDULES = ("gpipe", "1f1b", "interleaved", "dfc", "bfc")


def _flat(events: Any) -> list[tuple[Any, ...]]:
    return sorted((r, e.name, e.start_s, e.dur_s, tuple(sorted((k, str(v)) for k, v in
                                                               e.args.items())))
                  for r in events for e in events[r])


@st.composite
def jobs(draw: Any, overlap: bool = False) -> dict[str, Any]:
    tp, pp, dp = draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    schedule = draw(st.sampled_from(SCHEDULES))
    vpp = draw(st.sampled_from([1, 2, 3])) if schedule not in ("gpipe", "1f1b") else 1
    m = pp * draw(st.integers(1, 3))
    noisy = draw(st.booleans()) and draw(st.booleans())  # background noise in 1 of 4
    data: dict[str, Any] = {
        "seed": draw(st.integers(0, 10**6)), "iterations": draw(st.integers(1, 2)),
        "schedule": schedule,
        "parallel": {"tp": tp, "pp": pp, "dp": dp, "vpp": vpp, "microbatches": m},
        "model": {"layers": 2 * pp * vpp, "hidden": 256, "heads": 4, "seq_len": 128,
                  "vocab": 1024},
        "cluster": {"gpus_per_node": draw(st.sampled_from([1, 2, 4, 8])),
                    "jitter": {"compute_sigma": 0.05 if noisy and draw(st.booleans()) else 0.0,
                               "link_sigma": 0.2 if noisy else 0.0}},
        "faults": draw(st.lists(faults(tp * pp * dp), max_size=3)),
        "allow_idle_faults": True,  # random ranks: a link may join ranks that never talk
    }
    _megatron_options(draw, data, overlap)
    if draw(st.booleans()):  # fixed costs: ties everywhere, the hardest case for ordering
        data["costs"] = {"forward_s": 1.0, "backward_s": 2.0, "p2p_s": 0.25,
                         "allreduce_s": 0.5, "optimizer_s": 0.1}
    return data


def _megatron_options(draw: Any, data: dict[str, Any], overlap: bool = False) -> None:
    """Issue overhead, per-class latencies, NIC sharing, sequence parallelism
    (reduce-scatter/all-gather), recomputation, the distributed optimizer, untied
    embeddings; ``overlap``: overlapped (asynchronous) gradient reduction and
    parameter gathering too, in buckets of several sizes."""
    data["parallel"]["sequence_parallel"] = draw(st.booleans())
    data["model"]["untie_embeddings"] = draw(st.booleans())
    data["cluster"]["gpu"] = {"op_overhead_us": draw(st.sampled_from([0.0, 7.0]))}
    data["cluster"]["links"] = {
        "intra_node_latency_us": draw(st.sampled_from([None, 2.0])),
        "inter_node_latency_us": draw(st.sampled_from([None, 9.0])),
        "nics_per_node": draw(st.sampled_from([None, 1, 2]))}
    training = {"recompute": draw(st.sampled_from(["none", "selective", "full"])),
                "distributed_optimizer": draw(st.booleans())}
    if overlap:
        training["overlap_grad_reduce"] = draw(st.booleans())
        if training["overlap_grad_reduce"] and training["distributed_optimizer"]:
            training["overlap_param_gather"] = draw(st.booleans())
        training["bucket_params"] = draw(st.sampled_from([None, 10**5, 10**6]))
    data["training"] = {k: v for k, v in training.items() if v is not None}


def faults(world: int) -> Any:
    rank = st.integers(0, world - 1)
    pair = st.tuples(rank, rank).filter(lambda p: p[0] != p[1]).map(list)
    return st.one_of(
        st.builds(lambda r, f, s: {"kind": "throttle", "rank": r, "factor": f, "start_s": s},
                  rank, st.sampled_from([1.3, 2.0]), st.sampled_from([0.0, 0.01])),
        st.builds(lambda p, f: {"kind": "slow_link", "ranks": p, "factor": f}, pair,
                  st.sampled_from([2.0, 4.0])),
        st.builds(lambda p: {"kind": "link_jitter", "ranks": p, "sigma": 0.5}, pair),
        st.builds(lambda r: {"kind": "clock_skew", "rank": r, "offset_us": 700.0,
                             "drift_ppm": 30.0}, rank),
        *new_kinds(rank, pair)) if world > 1 else st.just(
        {"kind": "throttle", "rank": 0, "factor": 1.5})


def new_kinds(rank: Any, pair: Any) -> list[Any]:
    """Host stalls, intermittent throttles, link flaps, crashes, device variation."""
    return [
        st.builds(lambda r, k, w: {"kind": "host_stall", "rank": r, "seconds": 0.003,
                                   "every_k_iterations": k, "where": w},
                  rank, st.sampled_from([1, 2]), st.sampled_from(["before_forward",
                                                                  "before_optimizer"])),
        st.builds(lambda r, k: {"kind": "throttle", "rank": r, "factor": 2.0, "period_s": 0.004,
                                "duty": 0.5, "every_k_iterations": k},
                  rank, st.sampled_from([1, 2])),
        st.builds(lambda p, t: {"kind": "link_flap", "ranks": p, "down_ms": 1.0, "every_s": 0.005,
                                "start_s": t, "retry_ms": 0.5}, pair, st.sampled_from([0.0, 0.002])),
        st.builds(lambda r, t: {"kind": "crash", "rank": r, "at_s": t}, rank,
                  st.sampled_from([0.003, 0.02])),
        st.just({"kind": "device_variation", "sigma": 0.1})]


# a flapping link with a fixed transfer time: the engine summed the wait and
# the transfer in another order than the interpreter (the last bit differed)
FLAP_FIXED_P2P = {
    "seed": 0, "iterations": 1, "schedule": "gpipe",
    "parallel": {"tp": 1, "pp": 2, "dp": 2, "microbatches": 2},
    "model": {"layers": 4, "hidden": 256, "heads": 4, "seq_len": 128, "vocab": 1024},
    "cluster": {"gpus_per_node": 1, "jitter": {"compute_sigma": 0.0, "link_sigma": 0.2},
                "gpu": {"op_overhead_us": 0.0}},
    "faults": [{"kind": "link_flap", "ranks": [0, 2], "down_ms": 1.0, "every_s": 0.005,
                "retry_ms": 0.5}],
    "allow_idle_faults": True,
    "costs": {"forward_s": 1.0, "backward_s": 2.0, "p2p_s": 0.25, "allreduce_s": 0.5,
              "optimizer_s": 0.1}}


@FAST
@given(data=jobs())
@example(data=FLAP_FIXED_P2P)
def test_reduced_compiled_run_equals_the_full_generator_run_event_for_event(
        data: dict[str, Any]) -> None:
    s = parse_scenario(data)
    reduced = run_sim(s)
    assert reduced.source is not None, "a static schedule runs on the compiled engine"
    assert _flat(reduced.events) == _flat(run_sim(s, engine="generator").events)
    assert reduced.clocks == run_sim(s, engine="generator").clocks


@FAST
@given(data=jobs())
def test_full_compiled_run_equals_the_reduced_one(data: dict[str, Any]) -> None:
    s = parse_scenario(data)
    assert _flat(run_sim(s, reduce=False).events) == _flat(run_sim(s).events)


@FAST
@given(data=jobs(overlap=True))
def test_every_pipeline_compiles_to_the_same_program(data: dict[str, Any]) -> None:
    s = parse_scenario(data)
    topo = topology_of(s)
    programs = rank_programs(s)
    compiled = [compile_pipe([programs[r] for r in pipe_ranks(topo, p)], pipe_ranks(topo, p), topo)
                for p in range(topo.dp * topo.tp)]
    assert all(c == compiled[0] for c in compiled)


def _classes(data: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
    return pipe_classes(build_cluster(parse_scenario(data))).classes


HEALTHY = {"schedule": "1f1b", "parallel": {"tp": 2, "pp": 4, "dp": 8, "microbatches": 8},
           "model": {"layers": 8, "hidden": 256, "heads": 4, "seq_len": 128, "vocab": 1024}}


def test_a_healthy_job_is_one_class_and_a_fault_splits_its_replica_and_column() -> None:
    assert _classes(HEALTHY) == (tuple(range(16)),)
    # rank 2 is (dp 1, pp 0, tp 0): pipeline 2 alone; the other pipeline of its
    # replica waits for it in TP collectives; its column in DP collectives.
    throttled = _classes({**HEALTHY, "faults": [{"kind": "throttle", "rank": 2, "factor": 2}]})
    assert (2,) in throttled and (3,) in throttled
    assert tuple(p for p in range(0, 16, 2) if p != 2) in throttled
    assert tuple(p for p in range(1, 16, 2) if p != 3) in throttled
    assert len(throttled) == 4


def test_clock_skew_splits_nothing_and_noise_splits_everything() -> None:
    skewed = {**HEALTHY, "faults": [{"kind": "clock_skew", "rank": 5, "offset_us": 100.0}]}
    assert len(_classes(skewed)) == 1
    noisy = {**HEALTHY, "cluster": {"jitter": {"link_sigma": 0.1}}}
    assert len(_classes(noisy)) == 16


def test_each_replica_keeps_its_own_time_order_and_replicas_meet_at_data_parallel_collectives(
) -> None:
    s = parse_scenario({**HEALTHY, "cluster": {"jitter": {"link_sigma": 0.1}}})
    cluster = build_cluster(s)
    program = compile_static(s)
    assert program is not None
    engine = Engine(cluster, program, pipe_classes(cluster))
    topo = cluster.topo
    assert engine.block == [topo.coord(r).dp for r in engine.ranks]
    for keys in engine.coll_key:
        for kind, key in enumerate(keys):
            assert engine.cross[key] == (GROUP_KINDS[kind] == "dp")


def test_dynamic_programs_keep_the_generator_path() -> None:
    adaptive = parse_scenario({**HEALTHY, "schedule": "adaptive"})
    assert run_sim(adaptive).source is None

    def polls():
        yield WaitAny(())

    with pytest.raises(NotStatic):
        record(polls())


@FAST
@given(data=jobs(overlap=True))
def test_overlapped_gradient_reduction_compiles_and_records_what_the_generator_path_records(
        data: dict[str, Any]) -> None:
    """Asynchronous collectives (overlapped gradient reduction with dp > 1,
    and parameter gathering with it) run on the compiled engine, reduced and
    full, with the very events of the generator path: posts that go on,
    waits for their end, and collectives queued behind each other on one
    communicator."""
    s = parse_scenario(data)
    topo = topology_of(s)
    programs = rank_programs(s)
    recorded = [op for r in pipe_ranks(topo, 0) for op in record(programs[r])]
    asynchronous = any(isinstance(op, AllReduce) and op.async_op for op in recorded)
    assert asynchronous == (s.training.overlap_grad_reduce and topo.dp > 1)
    reduced = run_sim(s)
    assert reduced.source is not None
    reference = _flat(run_sim(s, engine="generator").events)
    assert _flat(reduced.events) == reference
    assert _flat(run_sim(s, reduce=False).events) == reference


def test_a_compiled_deadlock_names_each_blocked_rank() -> None:
    topo = Topology(pp=2)

    def receive_first(rank: int):
        yield Recv(src=1 - rank, tag="x", nbytes=8)
        yield Send(dst=1 - rank, tag="x", nbytes=8)

    program = compile_pipe([receive_first(0), receive_first(1)], (0, 1), topo)
    cluster = build_cluster(parse_scenario({"parallel": {"pp": 2}}))
    with pytest.raises(CompiledDeadlock) as err:
        run_compiled(cluster, program, identity_classes(topo))
    assert sorted(err.value.blocked) == [0, 1]
    assert isinstance(SimDeadlock(err.value.blocked), SimDeadlock)


def test_event_views_are_built_per_rank_from_the_compact_run() -> None:
    s = parse_scenario({**HEALTHY, "faults": [{"kind": "throttle", "rank": 2, "factor": 2}]})
    run = run_sim(s)
    assert run.source.events == sum(len(v) for v in run.events.values())
    first: Event = run.events[40][0]
    assert first.args["iteration"] == 0 and first.start_s >= 0.0


def test_the_compact_summary_equals_the_summary_of_every_rank() -> None:
    from megatronapp.trace.columns import source_of
    from megatronapp.dpp.windows import dpp_summary, dpp_summary_source
    from megatronapp.trace.summary import summarize, summarize_source

    s = parse_scenario({**HEALTHY, "schedule": "interleaved",
                        "parallel": {"tp": 2, "pp": 4, "dp": 8, "vpp": 2, "microbatches": 8},
                        "faults": [{"kind": "throttle", "rank": 2, "factor": 2},
                                   {"kind": "slow_link", "ranks": [3, 19], "factor": 3}]})
    run = run_sim(s)
    assert len(run.source.classes) < 16
    full = {r: list(run.events[r]) for r in run.events}
    compact, every = summarize_source(source_of(run)), summarize(full)
    assert compact["iteration_times_s"] == every["iteration_times_s"]
    assert compact["bubble_fraction"] == pytest.approx(every["bubble_fraction"], rel=1e-12)
    dpp_compact, dpp_every = dpp_summary_source(s, source_of(run)), dpp_summary(s, full)
    assert dpp_compact.keys() == dpp_every.keys()
    for key, value in dpp_every.items():
        assert dpp_compact[key] == (pytest.approx(value, rel=1e-12)
                                    if isinstance(value, float) else value), key
