"""``parallel.async_tp_backward``: the column-parallel layers' backward
collectives run under their GEMMs, as Megatron-LM has run them since 2022.

Megatron's ``LinearWithGradAccumulationAndAsyncCommunication.backward``
(megatron/core/tensor_parallel/layers.py; megatron/mpu/layers.py in the
Megatron-LM of Korthikanti et al. 2022) computes a column-parallel layer's
(QKV, first MLP projection) input gradient first and then reduces it
asynchronously while the weight gradient is computed: an all-reduce over the
tp group (``async_tensor_model_parallel_allreduce``), or with sequence
parallelism a reduce-scatter, ahead of which the layer's input, not kept
gathered from the forward, is all-gathered again under the input-gradient
GEMM. ``CUDA_DEVICE_MAX_CONNECTIONS=1`` makes the GEMM start first. A
collective longer than the GEMM under it shows its excess; the rest is
hidden. The row-parallel layers' backward all-gathers (sequence parallelism)
stay operations of their own. The Megatron-LM of Narayanan et al. 2021 had
none of this: its column-parallel backward all-reduced and waited.
"""
from __future__ import annotations

from ..scenario.config import Scenario
from .links import Exposed, beyond
from .tp_overlap import collective_s, overlaps

COLUMN_PARALLEL_GEMMS = ("qkv", "fc1")  # one reduction under each one's weight gradient


def runs_async(s: Scenario) -> bool:
    """Whether the column-parallel backward collectives run under GEMMs (and
    are no operations of their own); tp_comm_overlap's userbuffers take them
    over where it is on."""
    return s.async_tp_backward and s.parallel.tp > 1 and not overlaps(s)


def tp_async_exposed(s: Scenario, gemm_s: dict[str, float]) -> Exposed:
    """Per layer, the backward time the asynchronous collectives leave visible;
    ``gemm_s``: each of the layer's forward GEMMs' time on one rank (its input-
    and weight-gradient GEMMs have the same FLOPs)."""
    if not runs_async(s):
        return Exposed()
    one_pass = collective_s(s)  # an all-gather or reduce-scatter of the layer's activation
    # under each GEMM pair: the input gathered again (dgrad) and reduce-scattered (wgrad),
    # or without sequence parallelism an all-reduce, two ring passes, under wgrad
    under_each = (one_pass, one_pass) if s.sequence_parallel else (2 * one_pass,)
    exposed = sum(beyond(comm, gemm_s[name])
                  for name in COLUMN_PARALLEL_GEMMS for comm in under_each)
    return Exposed(0.0, exposed)

