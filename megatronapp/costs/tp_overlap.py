"""``parallel.tp_comm_overlap``: tensor-parallel collectives overlapped with GEMMs.

megatron-core hands Transformer Engine's userbuffers the layer's sequence-parallel
collectives (TELayerNormColumnParallelLinear / TERowParallelLinear with
``tp_comm_overlap``, megatron/core/extensions/transformer_engine.py; TE's default
overlap configuration): in forward each all-gather runs under the column-parallel
GEMM it feeds (QKV, first MLP projection) and each reduce-scatter under the
row-parallel GEMM that produces it (attention projection, second MLP
projection); in backward the all-gathers run under the row-parallel layers'
data-gradient GEMMs and the reduce-scatters under the column-parallel layers'
weight-gradient GEMMs, which are the same sizes. A collective longer than its
GEMM shows its excess; the rest is hidden. The collectives are then no longer
operations of their own (the trace has none).
"""
from __future__ import annotations

from ..scenario.config import Scenario
from .links import Exposed, beyond, ring_pass_s, span_link
from .memory import BYTES, local_seq_len

OVERLAPPED_GEMMS = ("qkv", "proj", "fc1", "fc2")  # one collective under each


def overlaps(s: Scenario) -> bool:
    return s.parallel.tp_comm_overlap and s.sequence_parallel


def collective_s(s: Scenario) -> float:
    """One all-gather or reduce-scatter of a layer's activation over the tp group."""
    m, tp = s.model, s.parallel.tp
    nbytes = m.micro_batch_size * local_seq_len(s) * m.hidden * BYTES[s.training.precision]
    return ring_pass_s(nbytes, tp, span_link(s, tp))


def tp_overlap_exposed(s: Scenario, gemm_s: dict[str, float]) -> Exposed:
    """``gemm_s``: each of the layer's GEMMs' time on one rank."""
    if not overlaps(s):
        return Exposed()
    comm = collective_s(s)
    exposed = sum(beyond(comm, gemm_s[name]) for name in OVERLAPPED_GEMMS)
    return Exposed(exposed, exposed)
