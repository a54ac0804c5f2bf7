"""Everything about Megatron's own memory estimate lives here, to set ours against.

Megatron-LM prints ``report_theoretical_memory``
(``megatron/training/theoretical_memory_usage.py`` at ``core_v0.16.1``) for the
most loaded rank: weights and optimizer state at 18 bytes per parameter (6 +
12/dp with the distributed optimizer: bf16 weights, fp32 gradients, an fp32
copy and Adam's two moments sharded), and, with sequence parallelism and
selective recomputation, Korthikanti et al.'s s·b·h·(18 + 4·f/h) per layer over
every layer, the embedding's inputs and dropout for pp microbatches, the
interleaved schedule's 1 + (p − 1)/(p·v), and the logits where pp = 1. It
counts K and V as wide as Q and no biases; it is written out here from those
formulas (``costs/memory.py`` is the simulator's own count).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..scenario.config import Scenario

NORM_PARAMS = 2  # a LayerNorm's weight and bias per hidden unit


@dataclass(frozen=True)
class TheoreticalMemory:
    """Megatron's estimate for the most loaded rank, in bytes."""

    weights_and_optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights_and_optimizer + self.activations


def most_loaded_params(s: Scenario) -> float:
    """A stage's share of the layers plus the embedding, over tp."""
    m, p = s.model, s.parallel
    h, vocab = m.hidden, s.padded_vocab
    gated = 1.5 if m.activation == "swiglu" else 1.0
    layer = (2 * h * (m.ffn * gated + NORM_PARAMS)
             + 2 * h * h * (1 + m.query_groups / m.heads))
    block = m.layers * layer + NORM_PARAMS * h
    params = (block / p.pp + h * vocab) / p.tp
    if m.untie_embeddings and p.pp == 1:
        params += h * vocab / p.tp
    return params


def theoretical_activations(s: Scenario) -> float:
    """The first stage's activations with sequence parallelism and selective recomputation."""
    m, p = s.model, s.parallel
    tokens = m.seq_len * m.micro_batch_size
    sbh = tokens * m.hidden
    act = sbh * (18 + 4 * m.ffn / m.hidden) * m.layers + (8 * tokens + sbh) * p.pp
    if p.vpp > 1:
        act *= 1 + (p.pp - 1) / (p.pp * p.vpp)
    elif p.pp > 1:
        act *= min(1.0, p.microbatches / p.pp)
    if p.pp == 1:
        act += 4 * sbh * (1 + s.padded_vocab / m.hidden)
    return act / p.tp


def theoretical_memory(s: Scenario) -> TheoreticalMemory:
    per_param = (6 + 12 / s.parallel.dp if s.training.distributed_optimizer else 18)
    return TheoreticalMemory(most_loaded_params(s) * per_param, theoretical_activations(s))
