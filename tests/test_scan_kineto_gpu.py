"""The Kineto reader on real GPU traces, kept in ``tests/data/gpu_kineto/``
(written on one NVIDIA H200, torch 2.11, NCCL 2.28.9; docs/megascan.md):

- ``megatron_run/``: ``megatronapp run tests/data/gpu_kineto/scenario.yaml
  --backend torch --profile`` (a megatron-core GPT, NCCL at world size 1):
  its own ``trace.parquet`` and ``summary.json`` beside ``profile/``;
- ``nccl_loop/``: ``tests/kineto_nccl_job.py``, an ordinary profiled job
  (matmuls, NCCL all-reduces, ``ProfilerStep`` ranges).

What these tests assert is what the reader gets right from them; what it
gets wrong is written down in docs/megascan.md ("A real GPU trace")."""
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


def busiest_stream(directory: Path) -> tuple[Any, Any]:
    """The (pid, tid) lane of the CUDA stream that ran the most GPU work."""
    lanes = Counter((e["pid"], e["tid"]) for e in raw_events(directory) if e.get("cat") in GPU_WORK)
    return lanes.most_common(1)[0][0]


def own_ops(name: str) -> int:
    """How many ``name`` ops the run's own tracer recorded (trace.parquet)."""
    return sum(e.name == name for evs in load_trace(RUN).events.values() for e in evs)


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


def test_compute_is_the_cuda_streams_annotations_one_per_op_of_the_run() -> None:
    """On the stream that ran the model, the reader finds one GPU range per
    forward, backward and optimizer op the run's own tracer recorded."""
    (path,) = kineto_files(PROFILE)
    rank = parse_kineto(read_json_any(path), str(path))
    stream = busiest_stream(PROFILE)
    on_stream = Counter(s.name for s in rank.compute if s.lane == stream)
    for op in ("forward", "backward", "optimizer"):
        assert on_stream[op] == own_ops(op) > 0
    work = [s for s in rank.compute if not s.name.startswith("ProfilerStep")]
    assert {s.cat for s in work} == {"gpu_user_annotation"}  # GPU time, not CPU ranges


def test_profiler_steps_of_an_ordinary_nccl_job_are_read_as_steps_not_work() -> None:
    job = load_kineto(kineto_files(LOOP))
    names = Counter((e.name, e.args["kind"]) for e in job.events[0])
    steps = {name for name, kind in names if name.startswith("ProfilerStep")}
    raw = Counter(e["name"] for e in raw_events(LOOP) if e.get("ph") == "X")
    assert steps and all(names[(s, "other")] == raw[s] for s in steps)  # CPU and GPU range each
    assert names[("forward", "compute")] == len(steps)  # one forward per profiled step


@pytest.mark.parametrize("directory", [PROFILE, LOOP], ids=["megatron_run", "nccl_loop"])
def test_analyze_and_detect_read_a_gpu_profile_directory(directory: Path, capsys) -> None:
    assert main(["analyze", str(directory), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["ranks"]) == {"0"}
    assert main(["detect", str(directory), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["root_causes"] == []  # one rank: nobody to blame
