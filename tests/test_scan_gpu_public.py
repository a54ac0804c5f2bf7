"""MegaScan on public torch.profiler traces of real GPU jobs (``tests/data/gpu_public/``,
HolisticTraceAnalysis' test data; see ``tests/data/README.md``): A100 and V100
ranks of NCCL jobs of 2 to 128 ranks, written by PyTorch versions with and
without collective metadata, files named as their writers named them.

Checked against the raw files and against HolisticTraceAnalysis itself
(``tests/hta_oracle.py``): per rank GPU window, compute, NCCL and idle time
within 3% of HTA's temporal breakdown; every NCCL kernel read as
communication, by the ``nccl:*`` range that launched it where the trace has
no collective metadata; idle fractions in [0, 1] on overlapping streams; the
2 of 128 ranks of one job named as a partial set, their shared collectives
matched and their NCCL kernels aligned."""
from __future__ import annotations

import gzip
import json
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from megatronapp.scan.align.inputs import load_scan_input
from megatronapp.scan.ingest.gpu import kernel_op
from megatronapp.scan.ingest.gpu_time import gpu_times
from megatronapp.scan.ingest.kineto import KinetoJob, kineto_files, load_kineto
from megatronapp.scan.ingest.kineto_spans import op_of
from megatronapp.scan.ingest.load import load_trace

from .hta_oracle import hta_figures
from .support import run_cli

PUBLIC = Path(__file__).resolve().parent / "data" / "gpu_public"
FOLDERS = sorted(p for p in PUBLIC.iterdir() if p.is_dir())
SAMPLED = PUBLIC / "sampled_128"  # ranks 0 and 1 of 128
THREE_STREAMS = PUBLIC / "a100_8"
WITHOUT_METADATA = [f for f in FOLDERS if f.name != "nccl_meta"]
COMM = ("collective", "p2p")


@cache  # read-only in these tests
def raw(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as fh:
        data: dict[str, Any] = json.load(fh)
    return data


def launched_nccl(path: Path) -> list[dict[str, Any]]:
    """The file's NCCL kernels whose CUDA launch it holds."""
    events = raw(path)["traceEvents"]
    launches = {e["args"]["correlation"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e["args"]}
    return [e for e in events if e.get("cat") == "kernel" and e["name"].startswith("nccl")
            and e["args"].get("correlation") in launches]


@cache
def read(folder: Path) -> KinetoJob:
    return load_kineto(kineto_files(folder))


def comm_events(folder: Path) -> dict[int, list[Any]]:
    return {r: [e for e in evs if e.args["kind"] in COMM] for r, evs in read(folder).events.items()}


def test_every_public_folder_is_found_whatever_its_files_are_named() -> None:
    names = {p.name for f in FOLDERS for p in kineto_files(f)}
    assert names == {"sampled_rank-0.json.gz", "sampled_rank-1.json.gz", "nccl_data.json.gz",
                     "rank0.json.gz", "control.json.gz", "test.json.gz",
                     "df_index_resolver.json.gz"}
    assert not any(n.endswith(".pt.trace.json.gz") for n in names)


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f.name)
def test_gpu_time_per_rank_is_hta_s_within_3_percent(folder: Path) -> None:
    ours = gpu_times(load_trace(folder).events)
    theirs = hta_figures(folder)
    assert sorted(ours) == sorted(theirs)  # ranks from distributedInfo, as HTA reads them
    for rank, t in ours.items():
        h = theirs[rank]
        got = {"window": t.window_s, "idle": t.idle_s, "compute": t.compute_s, "comm": t.comm_s}
        for key, seconds in got.items():
            assert seconds * 1e6 == pytest.approx(h[key], rel=0.03), (rank, key)


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f.name)
def test_no_nccl_kernel_is_lost(folder: Path) -> None:
    """Each NCCL kernel launched in the trace is one communication event (by
    the collective its metadata, its ``nccl:*`` range or its name says);
    those launched before the trace began are counted as set aside."""
    job = read(folder)
    comms = comm_events(folder)
    for path in kineto_files(folder):
        rank = raw(path)["distributedInfo"]["rank"]
        nccl = [e for e in raw(path)["traceEvents"] if e.get("cat") == "kernel"
                and e["name"].startswith("nccl")]
        assert len(comms[rank]) == len(launched_nccl(path)) > 0
        assert job.nccl_kernels[str(path)] == len(nccl)
        assert {e.args["cat"] for e in comms[rank]} == {"kernel"}
        assert "nccl" not in {e.name for e in comms[rank]}  # every one identified


def nccl_ranges(path: Path) -> Counter[str]:
    """The file's ``nccl:<op>`` ranges, by op."""
    return Counter(op_of(e["name"]) for e in raw(path)["traceEvents"]
                   if e.get("cat") == "user_annotation" and e["name"].startswith("nccl:"))


@pytest.mark.parametrize("folder", WITHOUT_METADATA, ids=lambda f: f.name)
def test_without_metadata_each_kernel_is_a_collective_its_nccl_ranges_name(folder: Path) -> None:
    """Older PyTorch records no collective name: every NCCL kernel is read as
    one of the collectives the file's ``nccl:<op>`` ranges name."""
    for path in kineto_files(folder):
        data = raw(path)
        assert not any("Collective name" in e.get("args", {}) for e in data["traceEvents"])
        read = Counter(e.name for e in comm_events(folder)[data["distributedInfo"]["rank"]])
        assert sum(read.values()) == len(launched_nccl(path))
        assert set(read) <= set(nccl_ranges(path))


def test_sendrecv_kernels_are_the_collective_whose_range_launched_them() -> None:
    """On the 128-rank job NCCL ran every collective as ``SendRecv`` kernels:
    the kernel name says nothing, the ranges say all-to-all, all-reduce,
    all-gather, one kernel each."""
    for path in kineto_files(SAMPLED):
        assert {kernel_op(e["name"]) for e in launched_nccl(path)} == {"sendrecv"}
        rank = raw(path)["distributedInfo"]["rank"]
        assert Counter(e.name for e in comm_events(SAMPLED)[rank]) == nccl_ranges(path)


def test_metadata_gives_the_group_even_of_a_rank_whose_peer_is_absent() -> None:
    """``Process Group Ranks: "[0, 1]"`` on a file of rank 0 alone: the
    collectives keep their group (``query`` shows it)."""
    comms = comm_events(PUBLIC / "nccl_meta")[0]
    assert comms and all(e.args["group"] == [0, 1] for e in comms)
    done = run_cli("query", str(PUBLIC / "nccl_meta"), "SELECT DISTINCT group_ranks FROM events "
                   "WHERE kind = 'collective'", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [{"group_ranks": "0,1"}]


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f.name)
def test_idle_fractions_stay_in_0_1(folder: Path) -> None:
    done = run_cli("analyze", str(folder), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert 0.0 <= report["bubble_fraction"] <= 1.0
    for t in report["ranks"].values():
        assert min(t["compute_s"], t["comm_s"], t["idle_s"]) >= 0
        assert t["compute_s"] + t["comm_s"] + t["idle_s"] == pytest.approx(t["gpu"]["window_s"])


def test_kernels_on_three_streams_are_a_union_not_a_sum() -> None:
    """The A100 rank runs kernels on three streams at once: their durations
    add up to more than its busy time, which its window holds."""
    (path,) = kineto_files(THREE_STREAMS)
    kernels = [e for e in raw(path)["traceEvents"] if e.get("cat") == "kernel"]
    assert len({e["tid"] for e in kernels}) == 3
    (t,) = gpu_times(load_trace(THREE_STREAMS).events).values()
    assert sum(e["dur"] for e in kernels) * 1e-6 > t.busy_s
    assert 0 < t.busy_s < t.window_s and t.overlap_s > 0


def test_two_ranks_of_128_are_named_a_partial_set() -> None:
    done = run_cli("detect", str(SAMPLED), "--json")
    assert done.returncode == 0, done.stderr
    (line,) = done.stderr.splitlines()
    assert "2 of the 128 ranks" in line and "missing: 2-127" in line
    report = json.loads(done.stdout)
    assert report["world_size"] == 128 and report["missing_ranks"] == list(range(2, 128))


def test_the_two_ranks_all_gathers_are_matched_and_their_kernels_aligned() -> None:
    """The two files hold a sample of each rank's events: only the all-gathers
    (their own communicator's stream) meet in order on both ranks; they are
    matched as collectives of the 128-rank default group, and aligning the
    clocks on them brings each pair's kernel ends together."""
    scan = load_scan_input(SAMPLED)
    matched = [op for op in scan.ops if op.kind == "collective"]
    per_rank = Counter(e.name for e in comm_events(SAMPLED)[0])
    assert len(matched) == per_rank["allgather"] == 2
    assert all(op.name == "allgather" and op.ranks == (0, 1) for op in matched)
    raw_events = load_trace(SAMPLED).events
    for op in matched:
        (r0, i0), (r1, i1) = op.members
        before = abs(_end_of(raw_events[r0], scan.events[r0][i0]) -
                     _end_of(raw_events[r1], scan.events[r1][i1]))
        after = abs(scan.events[r0][i0].end_s - scan.events[r1][i1].end_s)
        assert after < before < 1e-3  # one host: the raw clocks were close already


def _end_of(raw_events: list[Any], aligned: Any) -> float:
    """The raw end of the NCCL kernel ``aligned`` was made from (its stream and name)."""
    candidates = [e for e in raw_events if e.name == aligned.name
                  and e.args.get("stream") == aligned.args.get("stream")]
    return min((e.end_s for e in candidates), key=lambda end: abs(end - aligned.end_s))


def test_nccl_kernel_names_say_what_they_run() -> None:
    assert kernel_op("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)") == "allreduce"
    assert kernel_op("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "sendrecv"
    assert kernel_op("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL") == "reducescatter"
    assert kernel_op("ncclSomethingElse") == "nccl"
