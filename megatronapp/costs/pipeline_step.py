"""Everything about what a pipeline step pays for its own exchange lives here.

Megatron-core posts a step's point-to-point operations on the pipeline group's
one NCCL communicator (``p2p_communication.py``, ``_p2p_ops``), so on each GPU
they run one after another, and a send completes only once its receiver has
posted the matching receive; the next forward or backward waits for the
exchange (``schedules.py``: the wait handles before each step). With two
stages one direction goes over the world group instead, so the two do not
queue behind each other; the non-interleaved 1F1B batches a step's operations
into one group call (``batch_isend_irecv``), which NCCL runs together.

So each step holds its rank for its exchange: the operations that queue on one
communicator (two in the interleaved schedule past two stages, else one), each
costing ``cluster.gpu.p2p_op_us`` (launch, rendezvous and completion, fitted
per device and software generation) plus the link's latency and the message at
the link's bandwidth (NVLink where neighbouring stages share a node, else the
NIC). A scenario without ``p2p_op_us`` prices messages as they move, eagerly,
and pays nothing here.
"""
from __future__ import annotations

from ..scenario.config import Scenario
from .links import span_link


def queued_operations(s: Scenario) -> int:
    """Point-to-point operations of one step that run one after another."""
    p = s.parallel
    return 2 if p.vpp > 1 and p.pp > 2 else 1


def pipeline_step_s(s: Scenario, message_bytes: int) -> float:
    """What one pipeline step (a chunk's forward or backward) waits for its exchange."""
    p, op_us = s.parallel, s.cluster.gpu.p2p_op_us
    if op_us is None or p.pp == 1:
        return 0.0
    rate, latency = span_link(s, p.tp * p.cp * p.dp + 1)  # the next stage's rank
    return queued_operations(s) * (op_us * 1e-6 + latency + message_bytes / rate)
