"""What an event is: compute, communication, or neither (annotations)."""
from __future__ import annotations

from typing import Any, Literal, Mapping

Kind = Literal["compute", "comm", "other"]

COMPUTE_NAMES = frozenset({"forward", "backward", "optimizer", "recompute_forward"})
# Substrings of communication names in our traces, NCCL, gloo and torch profiles.
COMM_WORDS = ("send", "recv", "allreduce", "all_reduce", "allgather", "all_gather",
              "reducescatter", "reduce_scatter", "broadcast", "alltoall", "all_to_all",
              "nccl", "gloo", "barrier", "collective")
# Substrings of GPU kernel names (cuBLAS/CUTLASS/Triton/ATen) that mark compute.
KERNEL_WORDS = ("kernel", "gemm", "cutlass", "sm80", "sm90", "ampere", "hopper", "volta",
                "elementwise", "softmax", "layernorm", "flash", "triton", "matmul", "conv",
                "reduce_kernel", "vectorized", "forward", "backward", "optimizer", "adam")


def kind_of(name: str, args: Mapping[str, Any], cat: str | None = None) -> Kind:
    if "group" in args or "peer" in args:
        return "comm"
    lowered = name.lower()
    if any(w in lowered for w in COMM_WORDS):
        return "comm"
    if name in COMPUTE_NAMES or (cat or "").lower() in ("kernel", "gpu_op", "compute"):
        return "compute"
    if any(w in lowered for w in KERNEL_WORDS):
        return "compute"
    return "other"
