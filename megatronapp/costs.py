"""Per-rank costs of a scenario: compute durations, message sizes, memory.

The analytical model counts GPT FLOPs (Narayanan et al.: 24·b·s·h² + 4·b·s²·h
per layer forward with a 4h FFN, backward twice that) against the GPU's peak
times an efficiency. ``costs:`` in a scenario replaces it with fixed numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import Scenario

BYTES_PER_ELEMENT = 2  # bf16 activations and gradients
OPTIMIZER_BYTES_PER_PARAM = 16  # bf16 param + grad, fp32 master + Adam m, v
HBM_BYTES_PER_S = 3.0e12


@dataclass(frozen=True)
class StageCosts:
    """What one pipeline rank's program needs to know about durations and sizes."""

    forward_chunk_s: float  # one microbatch through one model chunk
    backward_chunk_s: float
    logits_forward_s: float  # extra on the last virtual stage (output layer)
    optimizer_s: float
    activation_bytes: int  # one microbatch's boundary activation (p2p payload)
    grad_bytes: int  # this rank's gradients, all-reduced over dp
    tp_allreduce_bytes: int  # per microbatch and chunk, forward and backward
    params_per_rank: int
    activation_mem_bytes_per_chunk: int  # stored for backward, per microbatch
    fixed_p2p_s: float | None
    fixed_allreduce_s: float | None

    @property
    def model_mem_bytes(self) -> int:
        return self.params_per_rank * OPTIMIZER_BYTES_PER_PARAM


def layer_forward_flops(s: Scenario) -> float:
    m = s.model
    b, seq, h, f = m.micro_batch_size, m.seq_len, m.hidden, m.ffn
    return 2 * b * seq * (4 * h * h + 2 * h * f) + 4 * b * seq * seq * h


def params_per_layer(s: Scenario) -> int:
    h, f = s.model.hidden, s.model.ffn
    return 4 * h * h + 2 * h * f + 9 * h  # attention, MLP, biases and norms


def stage_costs(s: Scenario) -> StageCosts:
    p, m, c = s.parallel, s.model, s.costs
    layers_per_chunk = m.layers // (p.pp * p.vpp)
    flops_per_s = s.cluster.gpu.tflops * 1e12 * s.cluster.gpu.efficiency
    fwd_chunk = layers_per_chunk * layer_forward_flops(s) / p.tp / flops_per_s
    logits = 2 * m.micro_batch_size * m.seq_len * m.hidden * m.vocab / p.tp / flops_per_s
    if c.forward_s is not None:
        fwd_chunk, logits = c.forward_s / p.vpp, 0.0
    bwd_chunk = 2 * fwd_chunk if c.backward_s is None else c.backward_s / p.vpp
    params = (layers_per_chunk * p.vpp * params_per_layer(s)) // p.tp
    params += m.vocab * m.hidden // p.tp  # embedding or output layer share
    act = m.micro_batch_size * m.seq_len * m.hidden * BYTES_PER_ELEMENT
    # Korthikanti et al.: s·b·h·(34 + 5·a·s/h) bytes per layer, split over tp.
    act_mem_layer = m.seq_len * m.micro_batch_size * m.hidden * (
        34 + 5 * m.heads * m.seq_len / m.hidden) / p.tp
    # Adam is memory-bound: read and write every optimizer byte once.
    optimizer = 0.0 if c.forward_s is not None else (
        2 * params * OPTIMIZER_BYTES_PER_PARAM / HBM_BYTES_PER_S)
    if c.optimizer_s is not None:
        optimizer = c.optimizer_s
    return StageCosts(
        forward_chunk_s=fwd_chunk,
        backward_chunk_s=bwd_chunk,
        logits_forward_s=logits,
        optimizer_s=optimizer,
        activation_bytes=act,
        grad_bytes=params * BYTES_PER_ELEMENT,
        tp_allreduce_bytes=2 * layers_per_chunk * act if p.tp > 1 else 0,
        params_per_rank=params,
        activation_mem_bytes_per_chunk=int(layers_per_chunk * act_mem_layer),
        fixed_p2p_s=c.p2p_s,
        fixed_allreduce_s=c.allreduce_s,
    )
