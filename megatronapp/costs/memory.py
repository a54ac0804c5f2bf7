"""Memory of a Megatron rank: weights, gradients, optimizer state, activations.

Activations per layer follow Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models" (2022), Table 2, with s sequence,
b micro-batch, h hidden, a heads, t tensor-parallel size (16-bit values,
1-byte dropout masks):

    no parallelism              s·b·h·(34 + 5·a·s/h)
    tensor parallel             s·b·h·(10 + 24/t + 5·a·s/(h·t))
    + sequence parallel         s·b·h·(34/t + 5·a·s/(h·t))
    tensor parallel + selective s·b·h·(10 + 24/t)
    + sequence parallel         s·b·h·34/t
    full recomputation          2·s·b·h (divided by t with sequence parallelism)

The 34 splits into 10 that tensor parallelism leaves replicated (layer norms,
dropout masks, the inputs of the QKV and first MLP projections) and 24 that it
splits; grouped-query attention and the MLP width change the 24 (see
``split_bytes``). Weights, gradients and optimizer state per parameter follow
Megatron-core's distributed-optimizer table: bf16 weights with fp32 gradients
6 + 12/d bytes, fp16 4 + 16/d, fp32 8 + 8/d (d = data-parallel size when the
optimizer is distributed, else 1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..scenario.config import Scenario, Training
from ..scenario.pipeline_split import chunk_layers, max_chunk_layers, rank_chunk_layers
from .flops import recomputed_layers_per_chunk

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ADAM_MOMENTS = 8  # fp32 m and v


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter on one rank."""

    weights: float
    grads: float
    optimizer: float  # fp32 master weights, Adam moments, fp16's fp32 gradient copy

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def state_bytes(t: Training, dp: int) -> StateBytes:
    low = t.precision != "fp32"
    grads = 4 if (not low or t.grads_in_fp32) else 2
    optimizer = ADAM_MOMENTS + (4 if low else 0)  # + fp32 master weights
    if t.precision == "fp16" and not t.grads_in_fp32:
        optimizer += 4  # fp16 unscales into an fp32 gradient copy
    shards = dp if t.distributed_optimizer else 1
    return StateBytes(BYTES[t.precision], grads, optimizer / shards)


# ------------------------------------------------------------ activations
def local_seq_len(s: Scenario) -> int:
    """Tokens of each sequence one rank holds: 1/cp of them under context
    parallelism (costs/context_parallel.py), so every activation below is ÷ cp."""
    return s.model.seq_len // s.parallel.cp


def _sbh(s: Scenario) -> float:
    m = s.model
    return local_seq_len(s) * m.micro_batch_size * m.hidden


def replicated_bytes(s: Scenario) -> float:
    """The 10·s·b·h tensor parallelism does not split (sequence parallelism does):
    the two layer norms' inputs (4), the QKV and first MLP projections' inputs (4)
    and the attention's and the MLP's 1-byte dropout masks (2), which a layer
    without hidden dropout does not keep."""
    masks = 2 if s.model.hidden_dropout > 0 else 0
    return (8 + masks) * _sbh(s)


def split_bytes(s: Scenario) -> float:
    """The part tensor parallelism splits, 24·s·b·h for MHA with a 4h GELU MLP:
    Q and K (2·sbh + 2·sb·kv), V (2·sb·kv), the output projection's input
    (2·sbh), and the MLP's activation and second-projection inputs."""
    m = s.model
    sb = local_seq_len(s) * m.micro_batch_size
    kv = m.query_groups * (m.hidden // m.heads)
    mlp = (4 if m.activation == "swiglu" else 2) * m.ffn + 2 * m.ffn
    return 4 * _sbh(s) + 4 * sb * kv + sb * mlp


def scores_bytes(s: Scenario) -> float:
    """5·a·s²·b: softmax output (2), its dropout mask (1) and dropout output (2);
    without attention dropout the softmax output alone (2·a·s²·b)."""
    m = s.model
    per_score = 5 if m.attention_dropout > 0 else 2
    return per_score * m.heads * local_seq_len(s) * m.seq_len * m.micro_batch_size


def stored_scores_bytes(s: Scenario) -> float:
    """What attention keeps of its scores for backward, in the 16-bit units of
    Korthikanti's counts: all 5·a·s²·b unfused (megatron-core's
    DotProductAttention); with flash or fused attention (TEDotProductAttention)
    only the fp32 softmax statistics, one float per head and query (Dao et al.
    2022, FlashAttention), from which backward rebuilds the scores."""
    m = s.model
    if s.stores_scores:
        return scores_bytes(s)
    return 4 * m.heads * local_seq_len(s) * m.micro_batch_size / (BYTES[s.training.precision] / 2)


def layer_activation_bytes(s: Scenario, recompute: str | None = None) -> float:
    """Bytes one layer keeps for its backward, per microbatch, on one rank."""
    t = s.parallel.tp
    sp = t if s.sequence_parallel else 1
    scale = BYTES[s.training.precision] / 2  # the paper counts 16-bit activations
    recompute = recompute or s.training.recompute
    if recompute == "full":
        return 2 * _sbh(s) / sp * scale
    scores = 0.0 if recompute == "selective" else stored_scores_bytes(s) / t
    return (replicated_bytes(s) / sp + split_bytes(s) / t + scores) * scale


def chunk_activation_bytes(s: Scenario, layers: int | None = None) -> float:
    """Bytes a model chunk of ``layers`` layers (default: the largest chunk) keeps
    for its backward, per microbatch, on one rank.
    Partial recomputation (megatron-core TransformerBlock._checkpointed_forward):
    block stores the first k layers' inputs only and the rest whole; uniform
    stores the input of each group of k layers."""
    t = s.training
    if layers is None:
        layers = max_chunk_layers(s.parallel, s.model.layers)
    if t.recompute_method == "uniform" and t.recompute_num_layers:
        return math.ceil(layers / t.recompute_num_layers) * layer_activation_bytes(s)
    recomputed = recomputed_layers_per_chunk(s, layers) if t.recompute == "full" else layers
    return (recomputed * layer_activation_bytes(s)
            + (layers - recomputed) * layer_activation_bytes(s, "none"))


def rank_chunk_activation_bytes(s: Scenario, pp_rank: int) -> float:
    """The largest of stage ``pp_rank``'s chunks: what one slot of its schedule holds."""
    return max(chunk_activation_bytes(s, n)
               for n in rank_chunk_layers(s.parallel, s.model.layers, pp_rank))


def transient_activation_bytes(s: Scenario) -> float:
    """What recomputation rebuilds at once during backward: one layer, or one
    group of ``recompute_num_layers`` under the uniform method."""
    recompute = s.training.recompute
    if recompute == "full":
        group = s.training.recompute_num_layers if s.training.recompute_method == "uniform" else 1
        return (group or 1) * layer_activation_bytes(s, "none")
    if recompute == "selective":
        return stored_scores_bytes(s) / s.parallel.tp * BYTES[s.training.precision] / 2
    return 0.0


# -------------------------------------------------------------- parameters
def layer_params(s: Scenario) -> tuple[int, int]:
    """(split by tp, replicated) parameters of one transformer layer."""
    m = s.model
    h, f = m.hidden, m.ffn
    qkv = h + 2 * m.query_groups * (h // m.heads)
    fc1 = 2 * f if m.activation == "swiglu" else f
    split = h * qkv + qkv + h * h + h * fc1 + fc1 + f * h  # weights + column biases
    replicated = 2 * h + 4 * h  # row-parallel biases, two layer norms
    return split, replicated


def chunk_params(s: Scenario, pp_rank: int, chunk: int) -> int:
    """Parameters of model chunk ``chunk`` on one rank of pipeline stage ``pp_rank``:
    the word and position embeddings in the first chunk of the first stage, the
    final layer norm and the output layer in the last chunk of the last stage."""
    m, p = s.model, s.parallel
    split, replicated = layer_params(s)
    params = chunk_layers(p, m.layers, pp_rank, chunk) * (split // p.tp + replicated)
    embedding = s.padded_vocab * m.hidden // p.tp
    first = pp_rank == 0
    if first and chunk == 0:
        params += embedding + m.position_embedding_params  # word and position embeddings
    if pp_rank == p.pp - 1 and chunk == p.vpp - 1:
        params += 2 * m.hidden  # final layer norm
        if m.untie_embeddings or not first:
            params += embedding  # the output layer (a tied copy on another stage)
    return params


def stage_params(s: Scenario, pp_rank: int) -> int:
    """Parameters held by one rank of pipeline stage ``pp_rank``."""
    return sum(chunk_params(s, pp_rank, chunk) for chunk in range(s.parallel.vpp))


def max_stage_params(s: Scenario) -> int:
    return max(stage_params(s, r) for r in range(s.parallel.pp))


# ------------------------------------------------------------ one rank
@dataclass(frozen=True)
class RankMemory:
    """Peak memory of one rank of a pipeline stage, in bytes."""

    pp_rank: int
    weights: float
    grads: float
    optimizer: float
    activations: float  # stored for backward at the schedule's peak
    transient: float  # recomputation's working set; the last stage's logits for the loss
    buffers: float  # p2p buffers

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.activations
                + self.transient + self.buffers)

    def as_dict(self) -> dict[str, float]:
        return {"pp_rank": self.pp_rank, "weights": self.weights, "grads": self.grads,
                "optimizer": self.optimizer, "activations": self.activations,
                "transient": self.transient, "buffers": self.buffers, "total": self.total}


def rank_memory(s: Scenario, pp_rank: int, peak_chunks: int, buffers: float) -> RankMemory:
    """``peak_chunks``: microbatch-chunks whose activations are alive at once at
    the schedule's peak on this stage (p for 1F1B's first stage)."""
    per = state_bytes(s.training, s.parallel.dp_cp)
    params = stage_params(s, pp_rank)
    return RankMemory(
        pp_rank=pp_rank, weights=params * per.weights, grads=params * per.grads,
        optimizer=params * per.optimizer,
        activations=peak_chunks * rank_chunk_activation_bytes(s, pp_rank),
        transient=transient_activation_bytes(s) + (
            output_layer_bytes(s) if pp_rank == s.parallel.pp - 1 else 0.0),
        buffers=buffers)


def output_layer_bytes(s: Scenario) -> float:
    """What the output layer and the loss keep for one microbatch until its backward,
    on the last stage: fp32 logits and the 4·s·b·h around them, split over tp
    (Megatron's report_theoretical_memory, megatron/training/theoretical_memory_usage.py
    at core_v0.16.1: 4·s·b·h·(1 + V/h)/t; it counts them where pp = 1)."""
    sb = local_seq_len(s) * s.model.micro_batch_size
    return 4 * sb * (s.model.hidden + s.padded_vocab) / s.parallel.tp
