"""The GPU side of the Kineto reader on files built to each version's schema:
what identifies an NCCL kernel when the trace says little (a ``nccl:*``
range, the kernel's name), where its group and peer come from (group
ranks, a group name in ``pg_config``, start/stride/size, a ``nccl:send
0->1`` range), PyTorch 1.8's category names, and which thread's range a
kernel's work is named by."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from megatronapp.scan.ingest.kineto import kineto_files, load_kineto, parse_kineto

from .support import KINETO_BASE_NS, kineto_event, kineto_meta, write_kineto

PID, MAIN, AUTOGRAD, STREAM, NCCL_STREAM = 100, 1, 2, 7, 20


def gpu_file(rank: int, events: list[dict[str, Any]], world: int = 2,
             pg_config: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    info: dict[str, Any] = {"backend": "nccl", "rank": rank, "world_size": world}
    if pg_config is not None:
        info["pg_config"] = pg_config
    return {"schemaVersion": 1, "baseTimeNanoseconds": KINETO_BASE_NS,
            "traceEvents": kineto_meta(PID) + events, "distributedInfo": info}


def launched(name: str, at: float, dur: float, corr: int, *around: tuple[str, str],
             stream: int = STREAM, cat: str = "kernel", tid: int = MAIN,
             **kernel_args: Any) -> list[dict[str, Any]]:
    """A kernel launched at ``at`` on thread ``tid``, inside the CPU spans
    ``around`` ((name, cat), outermost first), running right after."""
    spans = [kineto_event(n, c, PID, tid, at - 10 + i, 30 - 2 * i)
             for i, (n, c) in enumerate(around)]
    return [*spans, kineto_event("cudaLaunchKernel", "cuda_runtime", PID, tid, at, 2.0,
                                 correlation=corr),
            kineto_event(name, cat, 0, stream, at + 5, dur, correlation=corr, stream=stream,
                         **kernel_args)]


def comms_of(data: dict[str, Any]) -> list[Any]:
    return list(parse_kineto(data, "rank.json").comms)


def test_a_bare_nccl_kernel_is_named_by_its_kernel(tmp_path: Path) -> None:
    data = gpu_file(0, [*launched("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", 100.0,
                                  50.0, 1, stream=NCCL_STREAM),
                        *launched("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
                                  300.0, 50.0, 2, stream=NCCL_STREAM)])
    assert [c.op for c in comms_of(data)] == ["allreduce", "sendrecv"]
    (events,) = load_kineto(kineto_files(write_kineto(tmp_path, {0: data}))).events.values()
    kinds = {e.name: e.args["kind"] for e in events if e.args.get("cat") == "kernel"}
    assert kinds == {"allreduce": "collective", "sendrecv": "p2p"}


def test_the_nccl_range_around_the_launch_beats_the_kernel_name() -> None:
    data = gpu_file(0, launched("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t", 100.0, 50.0, 1,
                                ("c10d::alltoall_base_", "cpu_op"),
                                ("record_param_comms", "cpu_op"),
                                ("nccl:all_to_all", "user_annotation"),
                                stream=NCCL_STREAM))
    data["traceEvents"][-3]["args"].update({"Input Dims": [[1024]], "Input type": ["float"]})
    (comm,) = comms_of(data)
    assert (comm.op, comm.nbytes, comm.group) == ("alltoall", 4096.0, None)


def test_a_group_named_in_pg_config_or_spelled_by_stride() -> None:
    config = [{"pg_name": "0", "pg_desc": "default_pg", "ranks": [0, 1, 2, 3]},
              {"pg_name": "7", "pg_desc": "DATA_PARALLEL_GROUP", "ranks": [1, 3]}]
    named = launched("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 100.0, 50.0, 1,
                     stream=NCCL_STREAM, **{"Collective name": "allreduce",
                                            "Process Group Name": "7", "dtype": "Float",
                                            "In msg nelems": 8})
    strided = launched("ncclDevKernel_AllGather_RING_LL", 300.0, 50.0, 2, stream=NCCL_STREAM,
                       **{"Collective name": "_allgather_base", "Global rank start": 0,
                          "Global rank stride": 2, "Group size": 2})
    first, second = comms_of(gpu_file(1, named + strided, 4, config))
    assert (first.op, first.group, first.role, first.nbytes) == ("allreduce", (1, 3), "dp", 32.0)
    assert (second.op, second.group) == ("allgather", (0, 2))


def test_a_send_range_names_its_peer_only_in_this_rank_s_numbering() -> None:
    ours = launched("ncclDevKernel_SendRecv", 100.0, 50.0, 1, ("nccl:send 2->3", "user_annotation"),
                    stream=NCCL_STREAM)
    other = launched("ncclDevKernel_SendRecv", 300.0, 50.0, 2,
                     ("nccl:send 0->1", "user_annotation"), stream=NCCL_STREAM)
    first, second = comms_of(gpu_file(2, ours + other, 4))
    assert (first.op, first.peer) == ("send", 3)
    assert (second.op, second.peer) == ("send", None)  # rank 0 of some group: not ours


def test_pytorch_1_8_categories_are_read_as_today_s() -> None:
    events = [*launched("volta_sgemm_128x64_nn", 100.0, 40.0, 1, ("forward", "user_annotation"),
                        cat="Kernel"),
              *launched("Memcpy HtoD (Pageable -> Device)", 200.0, 10.0, 2, cat="Memcpy")]
    for e in events:
        if e["cat"] == "cuda_runtime":
            e["cat"] = "Runtime"
    rank = parse_kineto(gpu_file(0, events), "rank0.json")
    assert rank.gpu is not None
    assert [(s.name, s.cat) for s in rank.compute] == [
        ("forward", "kernel"), ("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy")]


def test_backward_kernels_launched_by_autograd_s_thread_count_for_backward() -> None:
    events = [kineto_event("backward", "user_annotation", PID, MAIN, 90.0, 400.0),
              *launched("sgemm_nt", 150.0, 40.0, 1,
                        ("autograd::engine::evaluate_function: MmBackward0", "cpu_op"),
                        tid=AUTOGRAD),
              *launched("sgemm_nn", 600.0, 40.0, 2,
                        ("autograd::engine::evaluate_function: MmBackward0", "cpu_op"),
                        tid=AUTOGRAD)]
    rank = parse_kineto(gpu_file(0, events), "rank0.json")
    assert [s.name for s in rank.compute] == [
        "backward", "autograd::engine::evaluate_function: MmBackward0"]  # after it: the op


def test_work_launched_before_the_trace_began_is_set_aside() -> None:
    early = kineto_event("sgemm", "kernel", 0, STREAM, 5.0, 50.0, correlation=99, stream=STREAM)
    rank = parse_kineto(gpu_file(0, [early, *launched("sgemm", 100.0, 40.0, 1)]), "rank0.json")
    assert rank.gpu is not None and rank.gpu.set_aside == 1 and len(rank.compute) == 1

