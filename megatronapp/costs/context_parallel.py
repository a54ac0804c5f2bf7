"""Context parallelism: each of ``cp`` ranks holds 1/cp of every sequence.

megatron-core splits each sequence into 2·cp chunks and gives rank r chunks r
and 2·cp − 1 − r (utils.get_batch_on_this_cp_rank), so that causal attention's
work is balanced; every token-wise GEMM, activation and message then shrinks
by cp. Attention needs every key and value: TEDotProductAttention (cp_comm_type
"p2p", Transformer Engine's AttnFuncWithCPAndKVP2P) passes K and V around the
cp ranks in a ring, cp − 1 steps per layer, each step's transfer overlapped
with the attention on the chunk already there; backward passes K, V and their
gradients (twice the bytes) while it computes. What a step's transfer takes
beyond the step's attention is exposed, and added to the layer's time.
``cp_comm_type: all_gather`` gathers all of K and V first instead (below).
Gradients are reduced over the dp·cp ranks (the topology's data-parallel groups).
"""
from __future__ import annotations

from ..scenario.config import Scenario
from .flops import computed_core_share, layer_gemms
from .links import Exposed, beyond, ring_pass_s, span_link
from .memory import BYTES, local_seq_len


def gemm_shards(s: Scenario) -> int:
    """The ranks a layer's GEMM FLOPs are split over: tp by the weights, cp by the tokens."""
    return s.parallel.tp * s.parallel.cp


def kv_step_bytes(s: Scenario) -> int:
    """One ring step's K and V chunk on one tp rank: 2·b·(s/cp)·(g/t)·d values."""
    m = s.model
    kv_width = m.query_groups // s.parallel.tp * (m.hidden // m.heads)
    return 2 * m.micro_batch_size * local_seq_len(s) * kv_width * BYTES[s.training.precision]


def kv_exchange(s: Scenario, step_attention_s: float, backward_ratio: float) -> Exposed:
    """What exchanging K and V between the cp ranks leaves exposed per layer."""
    if s.parallel.cp == 1:
        return Exposed()
    if s.parallel.cp_comm_type == "all_gather":
        return all_gather_exchange(s)
    return ring_exchange(s, step_attention_s, backward_ratio)


def all_gather_exchange(s: Scenario) -> Exposed:
    """cp_comm_type all_gather (Transformer Engine's AttnFuncWithCPAndKVAllGather,
    Llama 3's form): every rank gathers all of K and V before its attention, so
    nothing hides the gather; backward gathers them again and reduce-scatters
    their gradients."""
    cp = s.parallel.cp
    gather = ring_pass_s(cp * kv_step_bytes(s), cp, span_link(s, s.parallel.tp * cp))
    return Exposed(gather, 2 * gather)


def ring_exchange(s: Scenario, step_attention_s: float, backward_ratio: float) -> Exposed:
    """``step_attention_s``: one step's attention (queries against one chunk of keys).
    The ring spans tp·cp consecutive ranks."""
    cp = s.parallel.cp
    rate, latency = span_link(s, s.parallel.tp * cp)
    transfer = kv_step_bytes(s) / rate + latency
    return Exposed((cp - 1) * beyond(transfer, step_attention_s),
                   (cp - 1) * beyond(2 * transfer, backward_ratio * step_attention_s))


def step_attention_flops(s: Scenario) -> float:
    """One rank's queries against one chunk of keys and values, per tp rank: of
    a causal step (the chunks balanced as above) half is computed."""
    g = layer_gemms(s)
    return (g.scores + g.attend) / (gemm_shards(s) * s.parallel.cp) * computed_core_share(s)
