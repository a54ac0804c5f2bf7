"""torch.profiler (Kineto) traces: the reader on traces built to Kineto's
schema (GPU/NCCL, which this machine cannot produce), and on real traces of a
profiled 4-rank gloo job (``tests/kineto_job.py``)."""
from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from megatronapp.cli import main
from megatronapp.scan.evidence.detect import megascan
from megatronapp.scan.align.inputs import load_scan_input
from megatronapp.scan.ingest.kineto import LOADED_PHASES, SKIPPED_PHASES, kineto_files, load_kineto
from megatronapp.scan.ingest.load import TraceError, load_trace
from .support import KINETO_BASE_NS, kineto_event, kineto_meta, write_kineto

ROOT = Path(__file__).resolve().parents[1]
# ------------------------------------------------- Kineto's schema, by hand
def nccl_rank_file(rank: int, slow: float, iterations: int = 8) -> dict:
    """A data-parallel pair on GPUs: forward/backward kernels under GPU
    annotations, an NCCL all-reduce per iteration launched from a
    ``record_param_comms`` call (linked by correlation id and a flow); each
    iteration in the ``ProfilerStep#N`` range ``profiler.step()`` writes."""
    pid, events, t, corr = 4000 + rank, kineto_meta(4000 + rank), 100.0, 100 * rank
    for it in range(iterations):
        step_start = t
        for name, base in (("forward", 900.0), ("backward", 1800.0)):
            dur = base * (slow if rank == 1 else 1.0) * (1 + 0.01 * ((it * 7 + rank) % 3))
            corr += 1
            events += [kineto_event(name, "user_annotation", pid, pid, t, 30.0),
                       kineto_event("cudaLaunchKernel", "cuda_runtime", pid, pid, t + 5, 4.0,
                          correlation=corr),
                       {"ph": "s", "id": corr, "pid": pid, "tid": pid, "ts": t + 5,
                        "cat": "ac2g", "name": "ac2g"},
                       kineto_event(name, "gpu_user_annotation", 0, 7, t + 20, dur),
                       kineto_event("ampere_sgemm_128x64_nn", "kernel", 0, 7, t + 20, dur,
                          correlation=corr, stream=7, device=0),
                       {"ph": "f", "id": corr, "pid": 0, "tid": 7, "ts": t + 20, "cat": "ac2g",
                        "name": "ac2g", "bp": "e"}]
            t += dur + 50
        corr += 1
        start = 20000.0 * (it + 1)
        last = 1 if slow > 1 else it % 2  # a slow rank keeps its peer waiting
        arrive = start + (40.0 if rank == last else 0.0)
        events += [kineto_event("record_param_comms", "cpu_op", pid, pid, arrive - 10, 20.0, **{
                       "Collective name": "allreduce", "dtype": "Float", "In msg nelems": 4096,
                       "Out msg nelems": 4096, "Group size": 2, "Process Group Name": "1",
                       "Process Group Description": "undefined", "Process Group Ranks": "[0, 1]"}),
                   kineto_event("cudaLaunchKernel", "cuda_runtime", pid, pid, arrive - 5, 3.0,
                      correlation=corr),
                   kineto_event("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                      "kernel", 0, 20, arrive, start + 300 - arrive, correlation=corr, stream=20)]
        t = start + 400
        events.append(kineto_event(f"ProfilerStep#{it}", "user_annotation", pid, pid,
                                   step_start, t - step_start))
    return {"schemaVersion": 1, "baseTimeNanoseconds": KINETO_BASE_NS, "traceEvents": events,
            "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2, "pg_config": [
                {"pg_name": "0", "pg_desc": "default_pg", "pg_size": 2, "ranks": [0, 1]},
                {"pg_name": "1", "pg_desc": "undefined", "pg_size": 2, "ranks": [0, 1]}]}}


def test_nccl_trace_gpu_kernels_and_collective_metadata(tmp_path):
    target = write_kineto(tmp_path / "prof", {r: nccl_rank_file(r, slow=1.5) for r in (0, 1)})
    job = load_kineto(kineto_files(target))
    events, phases = job.events, job.phases
    assert sorted(events) == [0, 1]
    for rank, evs in events.items():
        names = [e.name for e in evs]
        # GPU work comes from the GPU annotations; CPU-side launches are not work
        assert names.count("forward") == names.count("backward") == 8
        comms = [e for e in evs if "group" in e.args]
        assert len(comms) == 8 and all(e.args["group"] == [0, 1] for e in comms)
        assert all(e.args["bytes"] == 4096 * 4 for e in comms)
        assert all(e.name == "dp_allreduce" for e in comms)  # same work, no p2p: peers
    for seen in phases.values():
        assert set(seen) <= LOADED_PHASES | SKIPPED_PHASES and {"M", "C", "i", "s", "f"} <= set(seen)
    d = megascan(load_scan_input(target))
    assert [(c.rank, c.kind) for c in d.root_causes] == [(1, "compute")]


def test_healthy_nccl_pair_is_healthy_and_gzip_reads_the_same(tmp_path):
    plain = write_kineto(tmp_path / "plain", {r: nccl_rank_file(r, slow=1.0) for r in (0, 1)})
    packed = write_kineto(tmp_path / "gz", {r: nccl_rank_file(r, slow=1.0) for r in (0, 1)}, gz=True)
    assert megascan(load_scan_input(plain)).healthy
    assert load_trace(plain).events == load_trace(packed).events


def test_p2p_peers_from_metadata_map_group_ranks_to_global(tmp_path):
    def rank_file(rank: int) -> dict:
        role = "send" if rank == 2 else "recv"
        key = "Dst Rank" if role == "send" else "Src Rank"
        pid = 10 + rank
        events = kineto_meta(pid) + [
            kineto_event("record_param_comms", "cpu_op", pid, pid, 100.0, 10.0, **{
                "Collective name": role, "dtype": "BFloat16", "In msg nelems": 8,
                "Process Group Ranks": [2, 3], key: 1 if role == "send" else 0}),
            kineto_event("cudaLaunchKernel", "cuda_runtime", pid, pid, 105.0, 2.0, correlation=1),
            kineto_event("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "kernel", 0, 20,
               110.0 + rank, 50.0, correlation=1)]
        return {"schemaVersion": 1, "baseTimeNanoseconds": KINETO_BASE_NS, "traceEvents": events,
                "distributedInfo": {"rank": rank, "world_size": 4}}

    events = load_kineto(kineto_files(write_kineto(tmp_path, {2: rank_file(2), 3: rank_file(3)}))).events
    (send,) = [e for e in events[2] if e.name == "send"]
    (recv,) = [e for e in events[3] if e.name == "recv"]
    assert (send.args["peer"], recv.args["peer"], send.args["bytes"]) == (3, 2, 16)


def gloo_rank_file(rank: int, slow: float, iterations: int = 8) -> dict:
    """A data-parallel pair on CPU as Megatron runs it at tp 1: each forward
    ends in three all-reduces on the one-rank tensor-parallel group (the loss),
    each iteration ends in the data-parallel all-reduce, where the fast rank
    waits for the slow one. Gloo runs each group's calls on two threads of its
    own, alternately; nothing in the file says which group a call used. Each
    iteration is a ``ProfilerStep#N`` range."""
    pid, events = 6000 + rank, kineto_meta(6000 + rank)
    start, fwd = 1000.0, 3000.0
    for it in range(iterations):
        t = start
        dur = fwd * (slow if rank == 1 else 1.0) * (1 + 0.01 * ((it * 7 + rank) % 3))
        events.append(kineto_event("forward", "user_annotation", pid, pid, t, dur))
        for k in range(3):  # inside the forward, finished alone
            call = t + dur - 400 + 120 * k
            events += [kineto_event("c10d::allreduce_", "cpu_op", pid, pid, call, 60.0),
                       kineto_event("gloo:all_reduce", "user_annotation", pid, 11 + k % 2, call + 20, 15.0)]
        t += dur + 20
        events.append(kineto_event("backward", "user_annotation", pid, pid, t, 2 * dur))
        t += 2 * dur + 20
        done = start + 3.2 * fwd * slow  # after the slow rank arrives: the sum
        events += [kineto_event("c10d::allreduce_", "cpu_op", pid, pid, t, 50.0),
                   kineto_event("gloo:all_reduce", "user_annotation", pid, 21 + it % 2, t + 10, done - t)]
        events.append(kineto_event(f"ProfilerStep#{it}", "user_annotation", pid, pid, start,
                                   done + 100 - start))
        start = done + 100
    return {"schemaVersion": 1, "baseTimeNanoseconds": KINETO_BASE_NS, "traceEvents": events,
            "host_name": "node0",
            "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 2, "pg_config": [
                {"pg_name": "0", "pg_desc": "default_pg", "pg_size": 2, "ranks": [0, 1]},
                {"pg_name": "1", "pg_desc": "DATA_PARALLEL_GROUP", "pg_size": 2,
                 "ranks": [0, 1]},
                {"pg_name": "2", "pg_desc": "TENSOR_MODEL_PARALLEL_GROUP", "pg_size": 1,
                 "ranks": [rank]}]}}


def test_one_rank_group_calls_inside_a_peers_wait_leave_its_group_alone(tmp_path):
    """The slow rank's one-rank calls fall inside its peer's long data-parallel
    wait, so they fit the pair's group in time; they are not its calls."""
    job = load_kineto(kineto_files(write_kineto(tmp_path, {r: gloo_rank_file(r, 4.0) for r in (0, 1)})))
    for evs in job.events.values():
        linked = [e for e in evs if "group" in e.args]
        assert [e.name for e in linked] == ["dp_allreduce"] * 8
        assert all(e.args["group"] == [0, 1] for e in linked)
        assert sum(e.name == "allreduce" and "group" not in e.args for e in evs) == 24
    d = megascan(load_scan_input(tmp_path))
    (cause,) = d.root_causes
    assert (cause.rank, cause.kind) == (1, "compute")
    # its forward and backward, 4x its peer's, judged in each of the 8 steps; the
    # peer only waited for it in their group's all-reduce
    ev = cause.evidence
    assert ev["expected_from"] == "peers" and ev["iterations_seen"] == 8
    assert ev["actual_s"] / ev["expected_s"] == pytest.approx(4.0, rel=0.02)
    assert d.victims == (0,)


def ddp_buffers_rank_file(rank: int, stalled: int, iterations: int = 6) -> dict:
    """Four data-parallel ranks whose module has buffers, as DDP runs it by
    default (``broadcast_buffers``): each of two forwards first broadcasts
    rank 0's buffers. ``stalled`` sleeps 20 ms in each optimizer step, so
    every rank but it waits for it in the next iteration's first broadcast;
    the second broadcast's root sends and leaves before the others arrive,
    so half of a rank's broadcast calls overlap no call of the root's."""
    pid, events = 7000 + rank, kineto_meta(7000 + rank)
    start, fwd, stall = 1000.0, 3000.0, 20000.0
    for it in range(iterations):
        t = start if rank == stalled or it == 0 else start - stall  # the others came early
        arrive_all = start  # the stalled rank's arrival ends the first broadcast
        for b in range(2):
            lane = 31 + b
            if b == 0:
                run_from, run_to = t + 5, arrive_all + 40 + rank
            else:  # the root is ahead: it sends and leaves, the others take it
                run_from = t + 5 + (0 if rank == 0 else 300)
                run_to = run_from + 30
            events += [kineto_event("c10d::broadcast_", "cpu_op", pid, pid, t, 3.0),
                       kineto_event("gloo:broadcast", "user_annotation", pid, lane, run_from,
                                    run_to - run_from)]
            t = run_to + 10
            events.append(kineto_event("aten::mm", "cpu_op", pid, pid, t, fwd))
            t += fwd + 10
        events.append(kineto_event("aten::mm", "cpu_op", pid, pid, t, 2 * fwd))
        t += 2 * fwd + 10
        done = arrive_all + 4 * fwd + 1000 + 10 * rank  # after the last arrives
        events += [kineto_event("c10d::allreduce_", "cpu_op", pid, pid, t, 20.0),
                   kineto_event("gloo:all_reduce", "user_annotation", pid, 33, t + 5, done - t - 5)]
        step = stall if rank == stalled else 100.0
        events.append(kineto_event("Optimizer.step#SGD.step", "user_annotation", pid, pid,
                                   done + 10, step))
        events.append(kineto_event(f"ProfilerStep#{it}", "user_annotation", pid, pid,
                                   start if it == 0 or rank == stalled else start - stall,
                                   done + step + 20 - (start if it == 0 or rank == stalled
                                                       else start - stall)))
        start = done + stall + 20 + 5 * rank
    return {"schemaVersion": 1, "baseTimeNanoseconds": KINETO_BASE_NS, "traceEvents": events,
            "host_name": "node0",
            "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 4, "pg_config": [
                {"pg_name": "0", "pg_desc": "default_pg", "pg_size": 4, "ranks": [0, 1, 2, 3]}]}}


def test_ddp_buffer_broadcasts_are_collectives_and_a_stalled_step_is_named(tmp_path):
    """A broadcast's root need not meet the others in time, so its calls are
    grouped by count (each member calls it as often): the ranks that waited
    for the stalled one in a broadcast waited for it, and it is named."""
    files = {r: ddp_buffers_rank_file(r, stalled=2) for r in range(4)}
    job = load_kineto(kineto_files(write_kineto(tmp_path, files)))
    for evs in job.events.values():
        casts = [e for e in evs if e.name.endswith("broadcast")]
        assert len(casts) == 12 and all(e.args.get("group") == [0, 1, 2, 3] for e in casts)
    d = megascan(load_scan_input(tmp_path))
    assert [(c.rank, c.kind) for c in d.root_causes][:1] == [(2, "compute")]


@pytest.mark.parametrize("edit, fragment", [
    (lambda d: d["traceEvents"].append({"ph": "X", "name": "k", "cat": "kernel", "pid": 0,
                                        "tid": 7, "ts": float("nan"), "dur": 1}),
     "'ts' must be a finite number"),
    (lambda d: d["traceEvents"].append({"ph": "Q", "name": "k"}), "unsupported phase 'Q'"),
    (lambda d: d["traceEvents"].append({"ph": "X", "name": "", "pid": 0, "ts": 1, "dur": 1}),
     "'name' must be a non-empty string"),
    (lambda d: d["distributedInfo"].update(rank="zero"), "'distributedInfo.rank'"),
    (lambda d: d["distributedInfo"].update(rank=10 ** 30), "'distributedInfo.rank'"),  # 32-bit
    (lambda d: d["traceEvents"].append(7), "not a JSON object"),
])
def test_malformed_kineto_trace_names_the_file_and_the_event(tmp_path, edit, fragment):
    data = nccl_rank_file(0, 1.0, iterations=1)
    edit(data)
    path = write_kineto(tmp_path, {0: data}) / "host_0.0.pt.trace.json"
    with pytest.raises(TraceError) as err:
        load_trace(path)
    assert str(err.value).startswith(str(path)) and fragment in str(err.value)


def test_cli_exit_2_on_a_malformed_kineto_directory(tmp_path, capsys):
    data = nccl_rank_file(0, 1.0, iterations=1)
    bad_index = len(data["traceEvents"])
    data["traceEvents"].append({"ph": "X", "name": "k", "cat": "kernel", "pid": 0, "tid": 7,
                                "ts": 5.0, "dur": -1.0})
    write_kineto(tmp_path, {0: data, 1: nccl_rank_file(1, 1.0, iterations=1)}, gz=True)
    code = main(["detect", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "host_0.0.pt.trace.json.gz" in err and f"event {bad_index}" in err


def test_a_rank_from_the_file_name_is_read_and_must_fit_32_bits(tmp_path):
    data = nccl_rank_file(0, 1.0, iterations=1)
    del data["distributedInfo"]
    (tmp_path / "rank3.pt.trace.json").write_text(json.dumps(data))
    assert sorted(load_kineto(kineto_files(tmp_path)).events) == [3]
    (tmp_path / "rank3.pt.trace.json").rename(tmp_path / "rank99999999999.pt.trace.json")
    with pytest.raises(TraceError, match="does not fit 32 bits"):
        load_trace(tmp_path)


def test_two_files_claiming_one_rank_of_one_cycle_are_refused_saying_what_to_do(tmp_path):
    write_kineto(tmp_path, {0: nccl_rank_file(0, 1.0, 1), 1: nccl_rank_file(0, 1.0, 1)})
    with pytest.raises(TraceError, match="rank 0 twice in one profiling cycle: .* keep one"):
        load_trace(tmp_path)


# ------------------------------------------------------ real profiled jobs
def _profiled_job(out: Path, *flags: str) -> Path:
    subprocess.run([sys.executable, str(ROOT / "tests" / "kineto_job.py"), str(out), *flags],
                   check=True, capture_output=True, timeout=600, cwd=ROOT)
    return out


@pytest.fixture(scope="module")
def slow_job(tmp_path_factory) -> Path:
    """Rank 1 does three times the work of its peers in every op."""
    return _profiled_job(tmp_path_factory.mktemp("kineto") / "slow", "--slow-rank", "1",
                         "--factor", "3", "--gzip")


@pytest.mark.slow
@pytest.mark.alone  # a slow rank judged on real timing
def test_real_profiled_job_names_the_slow_rank_plain_or_gzipped(slow_job, tmp_path, capsys):
    plain = tmp_path / "plain"
    plain.mkdir()
    for packed in kineto_files(slow_job):
        with gzip.open(packed, "rb") as src, open(plain / packed.name[:-3], "wb") as dst:
            shutil.copyfileobj(src, dst)
    answers = []
    for target in (slow_job, plain):
        assert main(["detect", str(target), "--json"]) == 0
        answers.append(json.loads(capsys.readouterr().out))
    assert answers[0] == answers[1]
    assert [(c["rank"], c["kind"]) for c in answers[0]["root_causes"]] == [(1, "compute")]


@pytest.mark.slow
@pytest.mark.alone  # a slow rank judged on real timing
def test_every_phase_of_a_real_trace_is_loaded_or_skipped_on_purpose(slow_job):
    job = load_kineto(kineto_files(slow_job))
    events, phases = job.events, job.phases
    assert job.one_clock  # one host: its clock is shared, nothing to align
    for path in kineto_files(slow_job):
        with gzip.open(path, "rt") as fh:
            raw = json.load(fh)["traceEvents"]
        present = Counter(str(e.get("ph")) for e in raw)
        assert phases[str(path)] == present  # the reader went through every event ...
        assert set(present) <= LOADED_PHASES | SKIPPED_PHASES  # ... each loaded or skipped
        assert {"X", "M"} <= set(present)
    for rank, evs in events.items():
        names = [e.name for e in evs]
        assert names.count("forward") == names.count("backward") == 12
        assert sum(1 for e in evs if e.name == "dp_allreduce") == 3  # its gradient all-reduces
        assert sum(1 for e in evs if "peer" in e.args) == 24  # every send and receive paired


@pytest.mark.slow
@pytest.mark.alone  # a slow rank judged on real timing
def test_analyze_align_query_and_plot_read_a_profile_directory(slow_job, tmp_path, capsys):
    assert main(["analyze", str(slow_job), "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["ranks"]) == {"0", "1", "2", "3"}
    assert main(["query", str(slow_job), "SELECT count(*) AS n FROM events WHERE name = "
                 "'forward'", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"n": 48}]
    out = tmp_path / "aligned.json"
    assert main(["align", str(slow_job), "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # 3 all-reduces on each of 2 groups; 12 sends each way on each of 2 pipelines
    assert report["sync_ops"] == 3 * 2 + 2 * 24 and out.is_file()
    plots = tmp_path / "plots"
    shutil.copytree(slow_job, plots)
    assert main(["plot", str(plots)]) == 0
    beside = tmp_path / "plots-megascan"  # never into the traces' folder
    assert (beside / "timeline.png").is_file() and (beside / "scan_heatmap.png").is_file()
    assert sorted(p.name for p in plots.iterdir()) == sorted(p.name for p in slow_job.iterdir())


@pytest.mark.slow
@pytest.mark.alone  # a slow rank judged on real timing
def test_real_profiled_healthy_job_names_nobody(tmp_path):
    healthy = _profiled_job(tmp_path / "healthy")
    assert megascan(load_scan_input(healthy)).healthy
