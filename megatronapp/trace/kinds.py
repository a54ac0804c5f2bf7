"""What an event is: compute, point-to-point, collective, or neither (annotations).

The one classifier of trace events. Our backends record each operation's kind
in its args (``ops.trace_args``), so for our traces this only reads it back.
Everything else is a fallback, kept here and nowhere else: traces we wrote
before the kind was recorded (a ``group`` arg marks a collective, a ``peer`` a
point-to-point op) and foreign traces (torch.profiler/Kineto, NCCL, gloo),
classified by name.
"""
from __future__ import annotations

from typing import Any, Literal, Mapping, cast, get_args

from ..parallel.ops import OP_KINDS, P2PRole

EventKind = Literal["compute", "p2p", "collective", "other"]
Stream = tuple[str, Any]  # ("tag", recorded tag) or ("name", direction in the name)

# Our compute operations (programs.py, fbd/workers.py).
COMPUTE_NAMES = frozenset({"forward", "backward", "optimizer", "recompute_forward"})
# Substrings of foreign point-to-point and collective names (NCCL, gloo, torch profiles).
P2P_WORDS = ("send", "recv")
COLLECTIVE_WORDS = ("allreduce", "all_reduce", "allgather", "all_gather", "reducescatter",
                    "reduce_scatter", "broadcast", "alltoall", "all_to_all", "nccl", "gloo",
                    "barrier", "collective")
# Substrings of GPU kernel names (cuBLAS/CUTLASS/Triton/ATen) that mark compute.
KERNEL_WORDS = ("kernel", "gemm", "cutlass", "sm80", "sm90", "ampere", "hopper", "volta",
                "elementwise", "softmax", "layernorm", "flash", "triton", "matmul", "conv",
                "reduce_kernel", "vectorized", "forward", "backward", "optimizer", "adam")
COMPUTE_CATEGORIES = ("kernel", "gpu_op", "compute")


def event_kind(name: str, args: Mapping[str, Any], cat: str | None = None) -> EventKind:
    """The recorded kind; else the legacy args test; else the name."""
    recorded = args.get("kind")
    if recorded in OP_KINDS:
        return cast(EventKind, recorded)
    if "group" in args:
        return "collective"
    if "peer" in args:
        return "p2p"
    return foreign_kind(name, cat)


def foreign_kind(name: str, cat: str | None = None) -> EventKind:
    """A foreign event's kind from its name (and Chrome category)."""
    lowered = name.lower()
    if any(w in lowered for w in P2P_WORDS):
        return "p2p"
    if any(w in lowered for w in COLLECTIVE_WORDS):
        return "collective"
    if name in COMPUTE_NAMES or (cat or "").lower() in COMPUTE_CATEGORIES:
        return "compute"
    if any(w in lowered for w in KERNEL_WORDS):
        return "compute"
    return "other"


def is_comm(kind: EventKind) -> bool:
    return kind in ("p2p", "collective")


def p2p_side(name: str, args: Mapping[str, Any]) -> tuple[P2PRole, Stream] | None:
    """(send | recv, stream) of a point-to-point event, else None. Sends and
    receives of one stream between two ranks pair up in order: the stream is
    the recorded tag, or for older traces the name's direction (``send_forward``
    and ``recv_forward`` share ``forward``)."""
    if "peer" not in args:
        return None
    role = args.get("role")
    if role in get_args(P2PRole):
        return cast(P2PRole, role), ("tag", args.get("tag"))
    lowered = name.lower()
    for word in get_args(P2PRole):
        if word in lowered:
            return word, ("name", lowered.replace(word, "", 1).strip("_"))
    return None
