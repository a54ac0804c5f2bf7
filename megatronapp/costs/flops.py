"""FLOPs of a GPT layer, GEMM by GEMM, and of a whole training iteration.

Counts follow Narayanan et al. (SC21, Eq. 3): a GEMM of an (m, k) by (k, n)
matrix is 2·m·k·n FLOPs; backward is twice forward; full activation
recomputation repeats each layer's forward (not the output layer's).
Grouped-query attention narrows the key/value projections; SwiGLU doubles the
first MLP projection.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..scenario.config import Scenario
from ..scenario.pipeline_split import max_chunk_layers, rank_chunk_layers

GEMM_NAMES = ("qkv", "scores", "attend", "proj", "fc1", "fc2")
ATTENTION_CORE = ("scores", "attend")  # what selective recomputation repeats
ATTENTION_BLOCK = ("qkv", "scores", "attend", "proj")  # the rest is the MLP block


@dataclass(frozen=True)
class LayerGemms:
    """Forward FLOPs of one layer's GEMMs for one microbatch (whole layer, not per rank)."""

    qkv: float
    scores: float
    attend: float
    proj: float
    fc1: float
    fc2: float

    def items(self) -> tuple[tuple[str, float], ...]:
        return tuple((name, getattr(self, name)) for name in GEMM_NAMES)

    @property
    def total(self) -> float:
        return sum(f for _, f in self.items())


def layer_gemms(s: Scenario) -> LayerGemms:
    m = s.model
    tokens, h, f = m.micro_batch_size * m.seq_len, m.hidden, m.ffn
    kv_width = m.query_groups * (h // m.heads)  # one of K, V
    fc1_width = 2 * f if m.activation == "swiglu" else f
    return LayerGemms(
        qkv=2 * tokens * h * (h + 2 * kv_width),
        scores=2 * tokens * m.seq_len * h,
        attend=2 * tokens * m.seq_len * h,
        proj=2 * tokens * h * h,
        fc1=2 * tokens * h * fc1_width,
        fc2=2 * tokens * f * h)


def computed_core_share(s: Scenario) -> float:
    """Of the attention core's counted FLOPs (QKᵀ and attention·V over the full
    s×s square, as Narayanan et al. count them), the share a causal kernel
    computes: flash and fused attention skip the blocks above the diagonal
    (FlashAttention-2, Dao 2023, §3.1.1), unfused attention computes them all
    and masks them."""
    return 1.0 if s.stores_scores else 0.5


def layer_forward_flops(s: Scenario) -> float:
    """One layer, one microbatch, forward (24·b·s·h² + 4·b·s²·h for a 4h GELU MLP)."""
    return layer_gemms(s).total


def logits_forward_flops(s: Scenario) -> float:
    m = s.model
    return 2 * m.micro_batch_size * m.seq_len * m.hidden * s.padded_vocab


def recompute_forward_flops(s: Scenario) -> float:
    """Extra forward FLOPs per layer and microbatch that recomputation adds."""
    g = layer_gemms(s)
    return {"none": 0.0, "selective": g.scores + g.attend, "full": g.total}[s.training.recompute]


def recomputed_layers_per_chunk(s: Scenario, layers: int | None = None) -> int:
    """Layers of a model chunk of ``layers`` layers (default: the largest chunk)
    recomputed before its backward: all of them unless ``recompute_method: block``
    limits them to the first few."""
    if s.training.recompute == "none":
        return 0
    if layers is None:
        layers = max_chunk_layers(s.parallel, s.model.layers)
    if s.training.recompute_method == "block" and s.training.recompute_num_layers:
        return min(s.training.recompute_num_layers, layers)
    return layers


def recomputed_layers(s: Scenario) -> int:
    """Layers recomputed per microbatch over the whole model."""
    if s.training.recompute_method == "block":
        p = s.parallel
        return sum(recomputed_layers_per_chunk(s, n) for r in range(p.pp)
                   for n in rank_chunk_layers(p, s.model.layers, r))
    return s.model.layers


def microbatches_per_iteration(s: Scenario) -> int:
    """Global batch in microbatches: every dp replica runs ``parallel.microbatches``."""
    return s.parallel.microbatches * s.parallel.dp


def model_flops_per_iteration(s: Scenario) -> float:
    """FLOPs the model needs (forward + backward, no recomputation): the MFU numerator."""
    per_mb = 3 * (s.model.layers * layer_forward_flops(s) + logits_forward_flops(s))
    return per_mb * microbatches_per_iteration(s)


def hardware_flops_per_iteration(s: Scenario) -> float:
    """FLOPs actually executed, recomputation included (Narayanan et al.'s Eq. 3
    for full recomputation)."""
    extra = recomputed_layers(s) * recompute_forward_flops(s) * microbatches_per_iteration(s)
    return model_flops_per_iteration(s) + extra
