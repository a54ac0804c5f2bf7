"""Everything about one GEMM's time on a device: its shape, a roofline, a
size-dependent efficiency and wave quantisation.

A GEMM of an (m, k) by (k, n) matrix, ``batch`` times, is cut into output
tiles; each streaming multiprocessor (SM) works on one tile at a time, so the
tiles run in waves of ``sm_count`` and the last, partial wave costs as much as
a full one (wave quantisation). The kernel picks the tile shape that wastes
least. Within a wave a GEMM reaches ``efficiency`` of peak once it is large;
smaller GEMMs reach less, efficiency·F/(F + F½) for F FLOPs, because fixed
costs (launch, prologue, epilogue) weigh more. A GEMM also cannot run faster
than HBM delivers its operands and result (the roofline). Without
``sm_count`` the device's geometry is unknown and a GEMM is its FLOPs at
``efficiency`` of peak, the model before shapes.

The per-rank shapes of a GPT layer follow Megatron's tensor parallelism:
column-parallel GEMMs (QKV, the first MLP projection, the logits) split n
over tp, row-parallel ones (the attention output projection, the second MLP
projection) split k, and the attention core is one GEMM per local head;
context parallelism gives each rank 1/cp of the tokens (m), its queries
meeting every key.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..scenario.config import Scenario
from .memory import local_seq_len

BF16_BYTES = 2


@dataclass(frozen=True)
class GemmShape:
    """(m, k) × (k, n), ``batch`` independent times."""

    m: int
    n: int
    k: int
    batch: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.batch

    @property
    def hbm_bytes(self) -> float:
        """Both operands read and the result written once (bf16)."""
        return BF16_BYTES * self.batch * (self.m * self.k + self.k * self.n + self.m * self.n)


@dataclass(frozen=True)
class GemmDevice:
    """The device constants a GEMM's time depends on."""

    peak_flops_per_s: float
    efficiency: float  # share of peak a large GEMM reaches
    half_flops: float  # F½: a GEMM of this many FLOPs reaches half of ``efficiency``
    overhead_s: float  # fixed time per GEMM (calibrate's constant)
    hbm_bytes_per_s: float
    sm_count: int | None = None  # None: no geometry, no waves and no roofline
    tiles: tuple[tuple[int, int], ...] = ((256, 128),)

    def size_efficiency(self, flops: float) -> float:
        """Share of peak within full waves: saturating in the GEMM's FLOPs."""
        return self.efficiency * flops / (flops + self.half_flops)

    def wave_fill(self, shape: GemmShape) -> float:
        """Useful share of the SM-tile slots the GEMM occupies, at the tile
        that wastes least: 1 when the tiles fill whole waves exactly."""
        if self.sm_count is None:
            return 1.0
        best = 0.0
        for tm, tn in self.tiles:
            tiles = shape.batch * math.ceil(shape.m / tm) * math.ceil(shape.n / tn)
            slots = math.ceil(tiles / self.sm_count) * self.sm_count * tm * tn
            best = max(best, shape.batch * shape.m * shape.n / slots)
        return best

    def seconds(self, shape: GemmShape, roofline: bool = True) -> float:
        """Compute time over the whole waves, or HBM time if longer."""
        flops = shape.flops
        if flops <= 0:
            return self.overhead_s
        compute = flops / (self.peak_flops_per_s * self.size_efficiency(flops) * self.wave_fill(shape))
        memory = shape.hbm_bytes / self.hbm_bytes_per_s if roofline and self.sm_count else 0.0
        return max(compute, memory) + self.overhead_s


def rank_layer_shapes(s: Scenario) -> dict[str, GemmShape]:
    """One layer's GEMMs on one rank, one microbatch, forward (names as
    ``flops.GEMM_NAMES``; each holds the layer's FLOPs over tp·cp)."""
    m, tp, seq = s.model, s.parallel.tp, local_seq_len(s)
    tokens, h, f = m.micro_batch_size * seq, m.hidden, m.ffn
    head = h // m.heads
    kv_width = m.query_groups * head
    fc1_width = 2 * f if m.activation == "swiglu" else f
    heads = m.micro_batch_size * m.heads // tp
    return {
        "qkv": GemmShape(tokens, (h + 2 * kv_width) // tp, h),
        "scores": GemmShape(seq, m.seq_len, head, heads),
        "attend": GemmShape(seq, head, m.seq_len, heads),
        "proj": GemmShape(tokens, h, h // tp),
        "fc1": GemmShape(tokens, fc1_width // tp, h),
        "fc2": GemmShape(tokens, h, f // tp),
    }


def rank_logits_shape(s: Scenario) -> GemmShape:
    """The output layer's GEMM on one rank: the vocabulary split over tp."""
    m = s.model
    return GemmShape(m.micro_batch_size * local_seq_len(s), s.padded_vocab // s.parallel.tp, m.hidden)


# The attention core's scores never go to HBM as a GEMM result: unfused
# attention's traffic over them is the elementwise work (stored activations),
# fused attention keeps them on chip.
ROOFLINE = {"qkv": True, "scores": False, "attend": False, "proj": True, "fc1": True, "fc2": True}
