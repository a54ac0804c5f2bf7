"""The Kineto reader on real GPU traces, kept in ``tests/data/gpu_kineto/``
(written on one NVIDIA H200, torch 2.11, NCCL 2.28.9; docs/megascan.md):

- ``megatron_run/``: ``megatronapp run tests/data/gpu_kineto/scenario.yaml
  --backend torch --profile`` (a megatron-core GPT, NCCL at world size 1):
  its own ``trace.parquet`` and ``summary.json`` beside ``profile/``;
- ``nccl_loop/``: ``tests/kineto_nccl_job.py``, an ordinary profiled job
  (matmuls, NCCL all-reduces, ``ProfilerStep`` ranges).

What these tests assert is what the reader gets right from them; what it
gets wrong is written down in docs/megascan.md ("A real GPU trace").
Public traces of real multi-rank GPU jobs are read in
``tests/test_scan_gpu_public.py``."""
from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from megatronapp.cli import main
from megatronapp.scan.ingest.kineto import (LOADED_PHASES, SKIPPED_PHASES, kineto_files, load_kineto,
                                     parse_kineto, read_json_any)
from megatronapp.scan.ingest.load import load_trace

DATA = Path(__file__).resolve().parent / "data" / "gpu_kineto"
RUN = DATA / "megatron_run"
PROFILE = RUN / "profile"
LOOP = DATA / "nccl_loop"
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def raw_events(directory: Path) -> list[dict[str, Any]]:
    (path,) = kineto_files(directory)
    with gzip.open(path, "rt") as fh:
        return list(json.load(fh)["traceEvents"])


@pytest.mark.parametrize("directory", [PROFILE, LOOP], ids=["megatron_run", "nccl_loop"])
def test_every_phase_of_a_gpu_trace_is_loaded_or_skipped_on_purpose(directory: Path) -> None:
    job = load_kineto(kineto_files(directory))
    (path,) = kineto_files(directory)
    present = Counter(str(e.get("ph")) for e in raw_events(directory))
    assert job.phases[str(path)] == present  # every event was looked at ...
    assert set(present) <= LOADED_PHASES | SKIPPED_PHASES  # ... and loaded or skipped
    assert {"s", "f"} <= set(present)  # CUDA launch flows (ac2g), autograd's (fwdbwd)
    assert list(job.events) == [0]
    assert job.hosts == {""}  # torch 2.11's GPU traces name no host_name


def test_rank_and_megatron_process_groups_come_from_distributed_info() -> None:
    (path,) = kineto_files(PROFILE)
    data = read_json_any(path)
    rank = parse_kineto(data, str(path))
    assert rank.rank == data["distributedInfo"]["rank"] == 0
    descs = {g.desc for g in rank.groups}
    assert len(rank.groups) == len(data["distributedInfo"]["pg_config"])
    assert {"default_pg", "TENSOR_MODEL_PARALLEL_GROUP", "DATA_PARALLEL_GROUP",
            "PIPELINE_MODEL_PARALLEL_GROUP"} <= descs
    assert all(g.ranks == (0,) for g in rank.groups)  # world size 1: every group is rank 0


def launched_kernels(directory: Path) -> list[dict[str, Any]]:
    """The raw GPU work whose CUDA launch the file holds."""
    events = raw_events(directory)
    launches = {e["args"]["correlation"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e["args"]}
    return [e for e in events if e.get("cat") in GPU_WORK
            and e["args"].get("correlation") in launches]


def test_compute_is_every_kernel_named_by_the_op_that_launched_it() -> None:
    """Every launched kernel is one compute event, named by the run's own op
    around its launch; backward's kernels (launched from autograd's thread,
    outside the main thread's ``backward`` range) count for backward, which
    does about twice forward's work. Each op's kernels take no longer than the
    run's own tracer timed the op."""
    events = load_kineto(kineto_files(PROFILE)).events[0]
    compute = [e for e in events if e.args["kind"] == "compute"]
    kernels = [e for e in launched_kernels(PROFILE) if e["cat"] == "kernel"]
    assert len(compute) == len(kernels) and {e.args["cat"] for e in compute} == {"kernel"}
    gpu_ms = Counter()
    for e in compute:
        gpu_ms[e.name] += e.dur_s * 1e3
    own_ms = Counter()
    for evs in load_trace(RUN).events.values():
        for e in evs:
            own_ms[e.name] += e.dur_s * 1e3
    for op in ("forward", "backward", "optimizer"):
        assert 0 < gpu_ms[op] <= own_ms[op]
    assert gpu_ms["backward"] > 1.5 * gpu_ms["forward"]


def test_kernels_take_the_profiler_step_their_launch_fell_in() -> None:
    """The loop runs the same forward every step: each profiled step gets
    the same number of forward kernels, by the step of their launch."""
    job = load_kineto(kineto_files(LOOP))
    names = Counter((e.name, e.args["kind"]) for e in job.events[0])
    steps = {name for name, kind in names if name.startswith("ProfilerStep")}
    raw = Counter(e["name"] for e in raw_events(LOOP) if e.get("ph") == "X")
    assert steps and all(names[(s, "other")] == raw[s] for s in steps)  # CPU and GPU range each
    forward = Counter(e.args.get("iteration") for e in job.events[0]
                      if e.name == "forward" and e.args["kind"] == "compute")
    assert set(forward) == {int(s.split("#")[1]) for s in steps}
    assert len(set(forward.values())) == 1


@pytest.mark.parametrize("directory", [PROFILE, LOOP], ids=["megatron_run", "nccl_loop"])
def test_analyze_and_detect_read_a_gpu_profile_directory(directory: Path, capsys) -> None:
    assert main(["analyze", str(directory), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["ranks"]) == {"0"}
    assert main(["detect", str(directory), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["root_causes"] == []  # one rank: nobody to blame
