"""What one torch.profiler (Kineto) event is, and what its name and arguments
say: the span, a communication call read from spans, a process group, and
the rules that tell communication from work (shared by the CPU reader in
``kineto`` and the GPU reader in ``gpu``).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

from megatronapp.trace.columns import is_int32

P2P_OPS = ("send", "recv")
# Collectives with a root: a broadcast's or scatter's root may send and leave
# before the others arrive, a reduce's or gather's others before the root
# does, so their members' calls need not overlap in time.
ROOTED_OPS = ("broadcast", "scatter", "reduce", "gather")
DTYPE_BYTES = {"float": 4, "float32": 4, "int": 4, "int32": 4, "uint32": 4, "double": 8,
               "float64": 8, "long": 8, "int64": 8, "half": 2, "float16": 2, "bfloat16": 2,
               "short": 2, "int16": 2, "byte": 1, "char": 1, "bool": 1, "int8": 1, "uint8": 1,
               "float8_e4m3fn": 1, "float8_e5m2": 1}
GROUP_ROLES = (("tensor", "tp"), ("data", "dp"), ("pipeline", "pp"), ("embedding", "embd"),
               ("context", "cp"), ("expert", "ep"))
STEP_PREFIX = "ProfilerStep"  # a whole iteration, waits included: not work
# ranges torch itself opens around work (FSDP2's hooks, FSDP1's, DDP,
# optimizers, a DataLoader's next batch): not the job's own
TORCH_RANGES = ("FSDP::", "FullyShardedDataParallel.", "DistributedDataParallel.",
                "Optimizer.", "enumerate(DataLoader)")
TORCH_ANNOTATIONS = (STEP_PREFIX, *TORCH_RANGES)
VARIANT_SUFFIX = re.compile(r"(base|coalesced|intotensor|tensor)+$")


@dataclass(frozen=True)
class Span:
    """One complete (``X``) event of a Kineto file, in µs on the job's time base."""

    index: int
    name: str
    cat: str
    lane: tuple[Any, Any]  # (pid, tid)
    start_us: float
    dur_us: float
    args: Mapping[str, Any]

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass(frozen=True)
class Comm:
    """One communication call on one rank; group/peer may still be unknown."""

    op: str  # allreduce, send, recv, allgather, ...
    start_us: float
    end_us: float
    nbytes: float
    group: tuple[int, ...] | None = None
    role: str = ""  # tp, dp, pp, ... from the group's description
    peer: int | None = None
    lane: Any = None  # the thread that ran it (gloo runs each process group on its own)
    # an NCCL kernel's: the CUDA stream it ran on, and when the CPU launched
    # it (its iteration is the one the launch falls in)
    stream: Any = None
    launched_us: float | None = None


@dataclass(frozen=True)
class ProcessGroup:
    ranks: tuple[int, ...]
    desc: str
    name: str = ""  # torch's pg_name, which NCCL calls' metadata refer to


def op_of(name: str) -> str:
    """c10d::allreduce_, gloo:all_reduce, nccl:all_reduce -> allreduce; the
    flat-tensor and coalesced variants (c10d::_allgather_base_,
    reduce_scatter_tensor_coalesced) are the collective they vary."""
    return VARIANT_SUFFIX.sub("", name.split(":")[-1].strip("_").replace("_", "").lower())


def is_comm_span(span: Span) -> bool:
    lowered = span.name.lower()
    return (lowered.startswith(("c10d::", "gloo:", "nccl:", "record_param_comms"))
            or (span.cat == "kernel" and lowered.startswith("nccl")))


def own_annotation(s: Span) -> bool:
    """A ``record_function`` range of the job's (not torch's, not communication)."""
    return s.cat == "user_annotation" and not is_comm_span(s) \
        and not s.name.startswith(TORCH_ANNOTATIONS)


def ranks_list(value: Any) -> tuple[int, ...] | None:
    """'Process Group Ranks' is a JSON list or its text ("[0, 1]"); never evaluated."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if isinstance(value, list) and value and all(map(is_int32, value)):
        return tuple(sorted(value))
    return None


@lru_cache(maxsize=256)  # called per collective kernel; a job has a few descriptions
def role_of(desc: str) -> str:
    """A group's role from its description: Megatron's words ("tensor model
    parallel group"), or a role's own short name as a word of it (a
    ``DeviceMesh`` dimension's group is described as ``mesh_<dimension>``:
    ``mesh_tp``, ``mesh_dp``)."""
    lowered = desc.lower()
    words = set(re.split(r"[^a-z0-9]+", lowered))
    return next((role for word, role in GROUP_ROLES if word in lowered or role in words), "")


def meta_bytes(args: Mapping[str, Any]) -> float:
    nelems = args.get("In msg nelems", args.get("Out msg nelems", 0))
    size = DTYPE_BYTES.get(str(args.get("dtype", "")).lower(), 0)
    return float(nelems) * size if isinstance(nelems, (int, float)) else 0.0


def shape_bytes(args: Mapping[str, Any]) -> float:
    """Bytes from record_shapes' ``Input Dims``/``Input type`` of a gloo:* or nccl:* range."""
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not isinstance(dims, list) or not isinstance(types, list) or not dims or not types:
        return 0.0
    first = dims[0]
    if isinstance(first, list) and all(isinstance(d, int) for d in first):
        return float(math.prod(first)) * DTYPE_BYTES.get(str(types[0]).lower(), 0)
    return 0.0
