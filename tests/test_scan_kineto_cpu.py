"""What ordinary CPU jobs' torch.profiler traces hold, read right: profiler
steps as iterations, FSDP2's group-less ``*_base`` collectives, send/recv
without recorded peers, and compute that is not annotated. Traces are built
to the schema gloo jobs write (``tests/zoo`` runs the real jobs)."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatronapp.scan.analyze import analyze
from megatronapp.scan.evidence.detect import Detector, megascan
from megatronapp.scan.align.inputs import load_scan_input
from megatronapp.scan.ingest.kineto import kineto_files, load_kineto, parse_kineto
from megatronapp.scan.ingest.kineto_spans import role_of

from .support import GLOO, MAIN, collective, gloo_file, kineto_event, write_kineto

ROOT = Path(__file__).resolve().parents[1]


def stepped_rank(rank: int, steps: int = 3) -> list[dict]:
    """Each step: a matmul, then an all-reduce every rank finishes together."""
    events, t = [], 1000.0
    for n in range(steps):
        events += [kineto_event(f"ProfilerStep#{n + 5}", "user_annotation", rank, MAIN, t, 1000.0),
                   kineto_event("aten::mm", "cpu_op", rank, MAIN, t + 10, 600.0 + 50 * rank),
                   *collective(rank, "allreduce_", "all_reduce", t + 700, t + 950)]
        t += 1000.0
    return events


def test_profiler_steps_are_the_iterations_of_every_event_on_every_thread(tmp_path):
    target = write_kineto(tmp_path, {r: gloo_file(r, 2, stepped_rank(r)) for r in (0, 1)})
    events = load_kineto(kineto_files(target)).events
    for evs in events.values():
        work = [e for e in evs if not e.name.startswith("ProfilerStep")]
        assert [e.args.get("iteration") for e in work] == [5, 5, 6, 6, 7, 7]
    assert len(analyze(events)["iteration_times_s"]) == 3


def fsdp_rank(rank: int, steps: int = 3) -> list[dict]:
    """FSDP2 on gloo: flat-tensor all-gathers and reduce-scatters (gloo runs
    the latter as an all-reduce), no process group recorded on any call."""
    events, t = [], 1000.0
    for n in range(steps):
        events += [kineto_event(f"ProfilerStep#{n}", "user_annotation", rank, MAIN, t, 2000.0),
                   *collective(rank, "_allgather_base_", "all_gather", t + 10, t + 300),
                   kineto_event("aten::mm", "cpu_op", rank, MAIN, t + 310, 500.0 + 100 * rank),
                   *collective(rank, "_reduce_scatter_base_", "all_reduce", t + 1000, t + 1900)]
        t += 2000.0
    return events


def test_fsdp2_base_collectives_link_across_ranks_and_count_as_communication(tmp_path):
    target = write_kineto(tmp_path, {r: gloo_file(r, 2, fsdp_rank(r)) for r in (0, 1)})
    events = load_kineto(kineto_files(target)).events
    for evs in events.values():
        linked = [(e.name, e.args.get("group")) for e in evs if e.args.get("cat") == "comm"]
        assert linked == [("dp_allgather", [0, 1]), ("dp_reducescatter", [0, 1])] * 3
    times = analyze(events)["ranks"]
    # the gathers' waits, and the reduce-scatters beyond each rank's matmul
    assert times["0"]["comm_s"] == pytest.approx(3 * (300.0 - 10.0 + 1900.0 - 1000.0) * 1e-6)


def ddp_rank(rank: int, wait_us: float, holder: tuple[str, str]) -> list[dict]:
    """An op (FSDP2's autograd functions) holding the backward matmul, the
    gradient all-reduce and the wait for it."""
    return [kineto_event("ProfilerStep#0", "user_annotation", rank, MAIN, 0.0, 5000.0),
            kineto_event(*holder, rank, MAIN, 100.0, 1000.0 + wait_us),
            kineto_event("aten::mm", "cpu_op", rank, MAIN, 110.0, 800.0),
            *collective(rank, "allreduce_", "all_reduce", 950.0, 1050.0 + wait_us),
            kineto_event("aten::add_", "cpu_op", rank, MAIN, 1200.0 + wait_us, 300.0)]


@pytest.mark.parametrize("holder", [
    ("autograd::engine::evaluate_function: RegisterPostBackwardFunctionBackward", "cpu_op"),
    ("FSDP::post_backward_reduce (0)", "user_annotation"),  # torch's own range (FSDP2)
    ("FullyShardedDataParallel._post_backward_hook", "user_annotation")])  # and FSDP1's
def test_an_op_holding_a_collective_wait_counts_only_its_ops_as_compute(tmp_path, holder):
    target = write_kineto(tmp_path, {r: gloo_file(r, 2, ddp_rank(r, 400.0, holder)) for r in (0, 1)})
    times = analyze(load_kineto(kineto_files(target)).events)["ranks"]
    for rank in ("0", "1"):
        # the matmul and the op after the holder
        assert times[rank]["compute_s"] == pytest.approx((800.0 + 300.0) * 1e-6)
        assert times[rank]["comm_s"] == pytest.approx((1050.0 + 400.0 - 950.0) * 1e-6)


def pipeline_files(slow_rank: int | None = None, link_delay_us: float = 0.0,
                   stages: int = 4, microbatches: int = 6) -> dict[int, dict]:
    """A 4-stage pipeline on gloo without ``record_shapes``: all forwards,
    then all backwards, each stage sending its output on with ``send`` and
    waiting in ``recv`` for its input; no op records its peer. Rank 2's
    receives from rank 1 may arrive ``link_delay_us`` late."""
    fwd = {r: 400.0 * (2.0 if r == slow_rank else 1.0) for r in range(stages)}
    events: dict[int, list[dict]] = {r: [] for r in range(stages)}
    ready: dict[tuple[int, int], float] = {}  # (stage, microbatch) -> input arrived
    free = {r: 0.0 for r in range(stages)}
    for direction in (1, -1):
        order = range(stages) if direction == 1 else range(stages - 1, -1, -1)
        for m in range(microbatches):
            for r in order:
                source = r - direction
                start = free[r]
                if 0 <= source < stages:  # wait for the input
                    delay = link_delay_us if {source, r} == {1, 2} else 0.0
                    arrive = max(start, ready[(source, m)]) + 50.0 + delay
                    events[r] += [kineto_event("c10d::recv_", "cpu_op", r, MAIN, start, 20.0),
                                  kineto_event("gloo:recv", "user_annotation", r, GLOO, start + 10,
                                     arrive - start - 10)]
                    start = arrive
                dur = fwd[r] * (1 if direction == 1 else 2)
                events[r].append(kineto_event("aten::mm", "cpu_op", r, MAIN, start, dur))
                done = start + dur
                if 0 <= r + direction < stages:  # send the output on
                    events[r] += [kineto_event("c10d::send", "cpu_op", r, MAIN, done, 20.0),
                                  kineto_event("gloo:send", "user_annotation", r, GLOO + 1, done + 10, 30.0)]
                    done += 20.0
                ready[(r, m)] = done
                free[r] = done
    return {r: gloo_file(r, stages, evs) for r, evs in events.items()}


@pytest.mark.parametrize("fault", [{}, {"slow_rank": 1}, {"link_delay_us": 3000.0}])
def test_send_recv_without_peers_never_name_a_link_the_pipeline_did_not_use(tmp_path, fault):
    target = write_kineto(tmp_path, pipeline_files(**fault))
    used = {frozenset((s, s + 1)) for s in range(3)}
    linked = {frozenset((r, e.args["peer"])) for r, evs in load_kineto(kineto_files(target))
              .events.items() for e in evs if "peer" in e.args}
    assert linked <= used
    diagnosis = megascan(load_scan_input(target))
    assert all(frozenset((c.rank, c.peer)) in used for c in diagnosis.root_causes
               if c.kind == "link")


def test_send_recv_without_peers_pair_where_the_counts_allow_one_routing(tmp_path):
    target = write_kineto(tmp_path, pipeline_files(stages=2))
    for rank, evs in load_kineto(kineto_files(target)).events.items():
        p2p = [e for e in evs if e.name in ("send", "recv")]
        assert len(p2p) == 12 and all(e.args.get("peer") == 1 - rank for e in p2p)


def late_woken_ddp_rank(rank: int, slow_us: float, sleeps: bool, woke_us: float,
                        steps: int = 6) -> list[dict]:
    """Annotated DDP without profiler steps, 4 ranks: ``backward`` holds a
    matmul, the gradient all-reduce (run on gloo's thread until the last
    rank's call plus 300 µs), the wait for it, ``woke_us`` more before the
    loaded machine wakes the thread (the reader took idle time as waiting
    only when the thread woke within 200 µs), and the copy of the bucket
    back. Rank 1 is ``slow_us`` late: a longer matmul, or a sleep after it."""
    events, t = [], 1000.0
    for _ in range(steps):
        call = {r: t + 2000.0 + (slow_us if r == 1 else 0.0) for r in range(4)}
        done = max(call.values()) + 300.0
        mm = 2000.0 + (slow_us if rank == 1 and not sleeps else 0.0)
        end = done + woke_us + 100.0
        events += [kineto_event("forward", "user_annotation", rank, MAIN, t - 500, 400.0),
                   kineto_event("aten::mm", "cpu_op", rank, MAIN, t - 450, 300.0),
                   kineto_event("backward", "user_annotation", rank, MAIN, t, end - t),
                   kineto_event("aten::mm", "cpu_op", rank, MAIN, t, mm),
                   *collective(rank, "allreduce_", "all_reduce", call[rank], done),
                   kineto_event("torch.distributed.ddp.reducer::copy_bucket_to_grad", "cpu_op",
                                rank, MAIN, done + woke_us, 100.0)]
        t = end + 1000.0
    return events


@pytest.mark.parametrize("sleeps", [False, True])
def test_an_annotation_loses_its_wait_for_a_later_peer_however_late_its_thread_woke(
        tmp_path, sleeps):
    """Each rank's ``backward`` keeps its own work, the transfer, the late
    wake-up and the copy; the healthy ranks' 2 ms waits for rank 1 go. Rank
    1 came last, so its sleep stays: it waited for no one."""
    files = {r: gloo_file(r, 4, late_woken_ddp_rank(r, 2000.0, sleeps, woke_us=3000.0))
             for r in range(4)}
    events = load_kineto(kineto_files(write_kineto(tmp_path, files))).events
    for rank in range(4):
        backward = [e.dur_s for e in events[rank] if e.name == "backward"]
        own = 2000.0 + (2000.0 if rank == 1 else 0.0)
        assert backward == pytest.approx([(own + 300.0 + 3000.0 + 100.0) * 1e-6] * 6)


def test_a_rank_others_wait_for_is_named_though_their_threads_woke_late(tmp_path):
    files = {r: gloo_file(r, 4, late_woken_ddp_rank(r, 2000.0, False, woke_us=2000.0))
             for r in range(4)}
    (cause,) = megascan(load_scan_input(write_kineto(tmp_path, files))).root_causes
    assert (cause.rank, cause.kind) == (1, "compute")


def test_a_send_handed_to_gloo_after_its_call_is_finished_by_its_own_work():
    """A slow link's thread hands a send to gloo 5 ms after the program
    called it; meanwhile the program calls another send, whose work gloo
    makes inside that call on the program's thread. Each call keeps its own
    work (the thread it ran on, and its end), not the next one to start."""
    link = MAIN + 50
    events = [kineto_event("c10d::send", "user_annotation", 0, MAIN, 100.0, 5.0),
              kineto_event("c10d::send", "cpu_op", 0, MAIN, 200.0, 50.0),
              kineto_event("gloo:send", "user_annotation", 0, MAIN, 210.0, 30.0),
              kineto_event("gloo:send", "user_annotation", 0, link, 5100.0, 40.0)]
    comms = parse_kineto(gloo_file(0, 2, events), "rank0").comms
    assert [(c.start_us, c.end_us, c.lane) for c in comms] == [
        (100.0, 5140.0, (0, link)), (200.0, 250.0, (0, MAIN))]


@pytest.mark.parametrize("desc, role", [("mesh_tp", "tp"), ("mesh_dp", "dp"), ("mesh_pp", "pp"),
                                        ("TENSOR_MODEL_PARALLEL_GROUP", "tp"),
                                        ("default_pg", ""), ("mesh_replicate", "")])
def test_a_device_mesh_dimensions_group_takes_its_role_from_the_dimensions_name(desc, role):
    assert role_of(desc) == role


def test_a_2d_mesh_on_gloo_keeps_every_ranks_peers_with_one_rank_slowed():
    # tensor-parallel pairs, data parallel across them (DeviceMesh "dp" x "tp"), rank 2
    # slowed 2x: its groups' roles come from the mesh, not from whether their members'
    # ops look alike (the slowed rank's extra rows make them differ)
    run = ROOT / "tests" / "data" / "heldout10" / "tp_dp_2d_mesh-slow-2x"
    scan = load_scan_input(run)
    detector = Detector(scan.gpus_per_node, scan.scenario)
    detector.feed(scan)
    bases = {e.who: e.basis for e in detector.evidence() if e.kind == "compute"}
    assert bases and set(bases.values()) == {"peers"}
