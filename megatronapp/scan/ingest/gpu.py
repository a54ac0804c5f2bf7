"""Everything about the GPU side of a torch.profiler (Kineto) trace lives here.

What a GPU trace holds, as every PyTorch version since 1.8 has written it:

- GPU work on CUDA streams: kernels, memory copies and sets (``kernel``,
  ``gpu_memcpy``, ``gpu_memset``; PyTorch 1.8 wrote ``Kernel``, ``Memcpy``,
  ``Memset``), each with the ``correlation`` id of the CUDA runtime (or
  driver) call that launched it on a CPU thread;
- that call sits inside the CPU ops and ``record_function`` ranges that
  issued it: a kernel's work is that of the job's innermost own range around
  its launch, else of the outermost op (autograd's backward ops run on their
  own thread, outside the job's ``backward`` range), else the kernel's own;
- NCCL kernels (``ncclKernel_AllReduce_RING_LL_Sum_float``,
  ``ncclDevKernel_SendRecv``): what collective each is comes from the
  collective metadata newer versions record (on the kernel, or on the
  ``record_param_comms`` op around the launch: collective name, process
  group ranks or name, sizes, peers), else from the ``nccl:<op>`` range around
  the launch (``nccl:all_to_all`` runs as ``SendRecv`` kernels), else from the
  kernel's name. None is dropped: an NCCL kernel is always communication.

Work whose launch is not in the trace was launched before profiling began
(the tail of an untraced step): it is set aside and counted, as
HolisticTraceAnalysis does, so that busy and idle time are the traced
steps'. Every span read here keeps the µs of its launch, which decides its
iteration (the GPU runs behind the CPU).
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Sequence

from megatronapp.trace.columns import is_int32

from megatronapp.scan.ingest.kineto_spans import (P2P_OPS, STEP_PREFIX, Comm, ProcessGroup, Span,
                                                  is_comm_span, meta_bytes, op_of,
                                                  own_annotation, ranks_list, role_of,
                                                  shape_bytes)

# PyTorch 1.8's categories, as the later names
LEGACY_CATS = {"Kernel": "kernel", "Memcpy": "gpu_memcpy", "Memset": "gpu_memset",
               "Runtime": "cuda_runtime", "Driver": "cuda_driver", "Operator": "cpu_op"}
WORK_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
MEMORY_CATS = frozenset({"gpu_memcpy", "gpu_memset"})
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver"})
ISSUING_CATS = frozenset({"cpu_op", "user_annotation"})
NCCL_KERNEL = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", re.IGNORECASE)
P2P_RANGE = re.compile(r"(\d+)\s*(->|<-)\s*(\d+)")  # "nccl:send 0->1", "nccl:recv 0<-1"
UNKNOWN_OP = "nccl"  # an NCCL kernel nothing names (still communication)
SENDRECV = "sendrecv"  # NCCL's kernel for send, recv and grouped all-to-all


def normal_cat(cat: str) -> str:
    return LEGACY_CATS.get(cat, cat)


def is_nccl_kernel(s: Span) -> bool:
    return s.cat == "kernel" and s.name.lower().startswith("nccl")


@dataclass(frozen=True)
class GpuRead:
    """A rank's GPU side: its work (kernels named by what issued them, memory
    operations by their own names; args ``kernel``, ``stream``,
    ``launched_us``), its NCCL kernels as communication, and how many
    activities were set aside (launched before the trace began)."""

    work: tuple[Span, ...]
    comms: tuple[Comm, ...]
    set_aside: int
    nccl_kernels: int  # NCCL kernels in the file, set-aside ones included


def read_gpu(spans: Sequence[Span], groups: Sequence[ProcessGroup], rank: int) -> GpuRead | None:
    """The GPU side of one file's spans (None: the file holds no GPU work)."""
    activities = [s for s in spans if s.cat in WORK_CATS]
    if not activities:
        return None
    launches = {s.args["correlation"]: s for s in spans
                if s.cat in LAUNCH_CATS and "correlation" in s.args}
    cpu = [s for s in spans if s.cat in ISSUING_CATS]
    chains = issuing_chains(cpu, launches.values())
    opened = open_annotations([s for s in cpu if own_annotation(s)], launches.values())
    # work recorded without a correlation id (some writers) goes by the GPU ranges around it
    ranges = issuing_chains([s for s in spans if s.cat == "gpu_user_annotation"],
                            [a for a in activities if "correlation" not in a.args])
    work: list[Span] = []
    comms: list[Comm] = []
    set_aside = 0
    for a in activities:
        launch = launches.get(a.args.get("correlation"))
        if launch is None and "correlation" in a.args and launches:
            set_aside += 1  # launched before the trace began
            continue
        chain = chains.get(launch.index, ()) if launch is not None else ranges.get(a.index, ())
        if launch is not None and launch.index in opened and not any(map(own_annotation, chain)):
            chain = (opened[launch.index], *chain)
        launched = launch.start_us if launch is not None else a.start_us
        if is_nccl_kernel(a):
            comms.append(replace(nccl_comm(a, chain, groups, rank), launched_us=launched))
        else:
            work.append(_work_span(a, chain, launched))
    return GpuRead(tuple(work), tuple(comms), set_aside, sum(map(is_nccl_kernel, activities)))


def stream_of(s: Span) -> Any:
    """The CUDA stream: the ``stream`` arg, else the lane's tid (``"stream 7"`` in 1.8)."""
    return s.args.get("stream", s.lane[1])


def _work_span(a: Span, chain: Sequence[Span], launched_us: float) -> Span:
    name = a.name if a.cat in MEMORY_CATS else issuer(chain) or a.name
    return replace(a, name=name, args={"kernel": a.name, "stream": stream_of(a),
                                       "launched_us": launched_us})


def issuer(chain: Sequence[Span]) -> str | None:
    """What issued a launch (its enclosing spans, outermost first; where its
    thread had no range of the job's open, the one another thread of its
    process had, ``open_annotations``): the job's innermost own range, else
    the outermost op, else the outermost of torch's ranges (iterations and
    communication aside)."""
    own = [s for s in chain if own_annotation(s)]
    if own:
        return own[-1].name
    work = [s for s in chain if not is_comm_span(s) and not s.name.startswith(STEP_PREFIX)]
    ops = [s for s in work if s.cat == "cpu_op"]
    return (ops or work)[0].name if (ops or work) else None


def issuing_chains(cpu: Iterable[Span], launches: Iterable[Span]) -> dict[int, tuple[Span, ...]]:
    """Launch span index -> the CPU spans of its thread around it, outermost first."""
    lanes: dict[Any, list[tuple[float, int, float, Span]]] = defaultdict(list)
    for s in cpu:
        lanes[s.lane].append((s.start_us, 0, -s.dur_us, s))
    for s in launches:
        lanes[s.lane].append((s.start_us, 1, 0.0, s))
    out: dict[int, tuple[Span, ...]] = {}
    for items in lanes.values():
        items.sort(key=lambda item: item[:3])
        stack: list[Span] = []
        for start, is_launch, _, s in items:
            while stack and stack[-1].end_us < start:
                stack.pop()
            if is_launch:
                out[s.index] = tuple(stack)
            else:
                stack.append(s)
    return out


def open_annotations(own: Iterable[Span], launches: Iterable[Span]) -> dict[int, Span]:
    """Launch span index -> the innermost of the job's own ranges open at the
    launch in its process, on any thread: autograd launches the backward
    kernels from its own thread while the thread that called ``backward()``
    holds the job's ``backward`` range."""
    by_pid: dict[Any, list[tuple[float, int, Span]]] = defaultdict(list)
    for s in own:
        by_pid[s.lane[0]].append((s.start_us, 0, s))
    for s in launches:
        by_pid[s.lane[0]].append((s.start_us, 1, s))
    out: dict[int, Span] = {}
    for items in by_pid.values():
        items.sort(key=lambda item: item[:2])
        active: list[Span] = []
        for start, is_launch, s in items:
            if not is_launch:
                active.append(s)
                continue
            active = [a for a in active if a.end_us >= start]
            if active:
                out[s.index] = max(active, key=lambda a: a.start_us)
    return out


# ------------------------------------------------------------------ NCCL
def nccl_comm(kernel: Span, chain: Sequence[Span], groups: Sequence[ProcessGroup],
              rank: int) -> Comm:
    """One NCCL kernel as communication, from the best source the trace has."""
    records = [s for s in reversed(chain) if s.name == "record_param_comms"]
    ranged = next((s for s in reversed(chain) if s.name.lower().startswith("nccl:")), None)
    meta = kernel.args if "Collective name" in kernel.args else next(
        (r.args for r in records if "Collective name" in r.args), None)
    sizes = [kernel.args, *(r.args for r in records)]
    nbytes = next((b for b in map(meta_bytes, sizes) if b > 0), 0.0) or (
        shape_bytes(ranged.args) if ranged is not None else 0.0)
    stream = (kernel.lane[0], stream_of(kernel))
    if meta is not None:
        return _from_meta(meta, kernel, nbytes, groups, stream)
    if ranged is not None:
        op, peer = _from_range(ranged.name, rank)
        return Comm(op, kernel.start_us, kernel.end_us, nbytes, peer=peer, lane=stream,
                    stream=stream[1])
    return Comm(kernel_op(kernel.name), kernel.start_us, kernel.end_us, nbytes, lane=stream,
                stream=stream[1])


def kernel_op(name: str) -> str:
    """ncclKernel_AllReduce_RING_LL_Sum_float -> allreduce; ncclDevKernel_SendRecv -> sendrecv."""
    found = NCCL_KERNEL.match(name)
    return found.group(1).lower() if found else UNKNOWN_OP


def _from_range(name: str, rank: int) -> tuple[str, int | None]:
    """``nccl:all_to_all`` -> (alltoall, None); ``nccl:send 0->1`` on rank 0 ->
    (send, 1). The range numbers ranks within the call's group: the peer is
    taken only where the rank it names for this side is this file's global
    rank (the default group's numbering)."""
    head, _, rest = name.partition(" ")
    op = op_of(head)
    found = P2P_RANGE.search(rest)
    if op not in P2P_OPS or found is None:
        return op, None
    left, arrow, right = int(found.group(1)), found.group(2), int(found.group(3))
    sender, receiver = (left, right) if arrow == "->" else (right, left)
    ours, theirs = (sender, receiver) if op == "send" else (receiver, sender)
    return op, theirs if ours == rank else None


def _from_meta(args: Mapping[str, Any], kernel: Span, nbytes: float,
               groups: Sequence[ProcessGroup], stream: tuple[Any, Any]) -> Comm:
    op = op_of(str(args.get("Collective name", ""))) or kernel_op(kernel.name)
    group = meta_group(args, groups)
    known = next((g for g in groups if g.ranks == group), None)
    role = role_of(str(args.get("Process Group Description", known.desc if known else "")))
    peer = None
    if op in P2P_OPS:
        raw = args.get("Dst Rank" if op == "send" else "Src Rank")
        if is_int32(raw):  # group-local: map through the group when known
            peer = group[raw] if group and 0 <= raw < len(group) else raw
    return Comm(op, kernel.start_us, kernel.end_us, nbytes, group if op not in P2P_OPS else None,
                role, peer, lane=stream, stream=stream[1])


def meta_group(args: Mapping[str, Any], groups: Sequence[ProcessGroup]) -> tuple[int, ...] | None:
    """The process group's global ranks: listed, else the group the trace's
    ``pg_config`` names, else spelled as start, stride and size."""
    listed = ranks_list(args.get("Process Group Ranks"))
    if listed is not None:
        return listed
    name = args.get("Process Group Name")
    named = next((g.ranks for g in groups if name is not None and g.name == str(name)), None)
    if named is not None:
        return named
    start, stride, size = (args.get(k) for k in ("Global rank start", "Global rank stride",
                                                  "Group size"))
    if is_int32(start) and is_int32(stride) and is_int32(size) and size > 0 and stride > 0:
        return tuple(range(start, start + stride * size, stride))
    return None
