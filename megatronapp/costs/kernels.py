"""Kernel times measured on a device: GEMMs by shape, attention by shape and
kernel, element-wise bandwidth (``cluster.gpu.kernels``).

``experiments/kernel_bench.py measure`` times, on one GPU, every per-rank GEMM
and attention shape of the published rows plus an m×n×k grid, and writes
``megatronapp/scenario/kernels/<device>.json``. A device with such a table
prices a GEMM at the rate measured for its shape, interpolated between the
measured shapes in log m, log n, log k (inverse-distance weighting of the
nearest ones: exact on a measured shape), fused and flash attention at the
rates measured for their kernel (cuDNN's fused attention, which
Megatron-core with Transformer Engine runs on Hopper; FlashAttention-2) by
shape, forward and backward, and element-wise work at the bandwidth its
kernels reached. The measured time is for a kernel running alone; a whole
training step runs its kernels ``kernel_time_factor`` slower (fitted on
published rows, docs/pricing.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from statistics import harmonic_mean
from typing import Any

from ..io import gate
from ..scenario.config import Scenario
from ..scenario.devices import KERNELS_DIR
from .gemm import GemmShape
from .memory import local_seq_len

NEIGHBOURS = 8  # measured shapes an unmeasured one is interpolated from
# Megatron's model.attention_backend: the measured kernel that runs it.
ATTENTION_KERNELS = {"fused": "cudnn", "flash": "flash"}


@dataclass(frozen=True)
class AttentionShape:
    """One rank's attention core for one microbatch: batch × local heads,
    query and key lengths, head width."""

    batch_heads: int
    sq: int
    sk: int
    head: int

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.batch_heads, self.sq, self.sk, self.head)


def attention_shape(s: Scenario) -> AttentionShape:
    m = s.model
    return AttentionShape(m.micro_batch_size * m.heads // s.parallel.tp, local_seq_len(s),
                          m.seq_len, m.hidden // m.heads)


@dataclass(frozen=True, eq=False)  # hashed by identity: memoised lookups
class LogTable:
    """Values measured at points, looked up exactly or interpolated in the
    logarithms of the coordinates (inverse squared distance, nearest points)."""

    points: tuple[tuple[int, ...], ...]
    values: tuple[float, ...]

    def __call__(self, point: tuple[int, ...]) -> float:
        return _interpolate(self, point)


@lru_cache(maxsize=65536)
def _interpolate(table: LogTable, point: tuple[int, ...]) -> float:
    target = [math.log(x) for x in point]
    nearest = sorted((sum((math.log(c) - t) ** 2 for c, t in zip(p, target)), v)
                     for p, v in zip(table.points, table.values))[:NEIGHBOURS]
    if nearest[0][0] == 0.0:
        return nearest[0][1]
    weights = [1.0 / d for d, _ in nearest]
    return sum(w * v for w, (_, v) in zip(weights, nearest)) / sum(weights)


@dataclass(frozen=True, eq=False)
class KernelTable:
    """A device's measured kernel rates (FLOP/s, bytes/s)."""

    gemm: LogTable  # (m, n, k) -> FLOP/s
    attention_forward: dict[str, LogTable]  # kernel -> (b·h, sq, sk, d) -> FLOP/s
    attention_backward: dict[str, LogTable]  # over 2.5× the forward's FLOPs
    elementwise_bytes_per_s: float

    def gemm_s(self, shape: GemmShape) -> float:
        """One GEMM (a batch of them: each at its single shape's rate)."""
        return shape.flops / self.gemm((shape.m, shape.n, shape.k))

    def covers_attention(self, backend: str) -> bool:
        return ATTENTION_KERNELS.get(backend) in self.attention_forward

    def attention_s(self, backend: str, shape: AttentionShape, flops: float) -> tuple[float, float]:
        """Forward and backward seconds of ``flops`` forward FLOPs of attention
        at ``shape``'s measured rates (backward: 2.5× the FLOPs, the scores rebuilt)."""
        kernel = ATTENTION_KERNELS[backend]
        return (flops / self.attention_forward[kernel](shape.key),
                2.5 * flops / self.attention_backward[kernel](shape.key))


def kernel_table(measured: dict[str, Any]) -> KernelTable:
    """The table from ``kernel_bench.py``'s output. GEMMs in Megatron's layout
    (weights stored transposed: ``s_bT``)."""
    gemms = measured["gemms"]
    forward: dict[str, list[tuple[tuple[int, ...], float]]] = {}
    backward: dict[str, list[tuple[tuple[int, ...], float]]] = {}
    for a in measured["attention"]:
        key = (a["b"] * a["h"], a["sq"], a["sk"], a["d"])
        forward.setdefault(a["backend"], []).append((key, a["fwd_flops"] / a["fwd_s"]))
        backward.setdefault(a["backend"], []).append(
            (key, 2.5 * a["fwd_flops"] / (a["fwd_bwd_s"] - a["fwd_s"])))
    return KernelTable(
        LogTable(tuple((g["m"], g["n"], g["k"]) for g in gemms),
                 tuple(2.0 * g["m"] * g["n"] * g["k"] / g["s_bT"] for g in gemms)),
        {k: _log_table(v) for k, v in forward.items()},
        {k: _log_table(v) for k, v in backward.items()},
        harmonic_mean([e["gbps_nominal"] * 1e9 for e in measured["elementwise"]]))


def _log_table(rows: list[tuple[tuple[int, ...], float]]) -> LogTable:
    return LogTable(tuple(p for p, _ in rows), tuple(v for _, v in rows))


@lru_cache(maxsize=8)
def load_kernel_table(name: str, directory: Path = KERNELS_DIR) -> KernelTable:
    path = directory / f"{name}.json"
    return kernel_table(gate.read_json(path, ""))
