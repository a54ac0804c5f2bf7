"""Per-rank costs of a scenario: compute durations, message sizes, memory.

The analytical model prices each of a layer's GEMMs (``flops.py``) at the
device's peak times ``efficiency`` plus a fixed ``gemm_overhead_us`` (small
GEMMs run slower), and the layer's elementwise work as memory traffic
(``elementwise_traffic`` bytes per stored activation byte, at ``hbm_tbps``),
plus ``module_overhead_us`` per module call (a layer, the embedding, the
output layer with its loss).
Backward takes ``backward_ratio`` times its forward. Tensor-parallel traffic
is not folded in: the rank programs issue each layer's collectives as
operations (``tp_layer_forward`` / ``tp_layer_backward``), unless
``tp_comm_overlap`` runs them under GEMMs (``tp_overlap.py``; the
column-parallel backward ones with ``async_tp_backward``, ``tp_async.py``: their
exposed part is folded in, as is context parallelism's K/V exchange,
``context_parallel.py``). Each chunk holds the layers its pipeline split gives
it (``scenario/pipeline_split.py``). ``costs:`` in a
scenario replaces compute durations with fixed numbers. Memory follows
``memory.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..scenario.config import Scenario
from ..scenario.pipeline_split import chunk_layers, first_layer, max_chunk_layers
from .flops import (ATTENTION_BLOCK, ATTENTION_CORE, computed_core_share,  # noqa: F401
                    layer_forward_flops, layer_gemms, logits_forward_flops,
                    recomputed_layers_per_chunk)
from .gemm import ROOFLINE, GemmDevice, GemmShape, rank_layer_shapes, rank_logits_shape
from .kernels import KernelTable, attention_shape, load_kernel_table
from .memory import (BYTES, chunk_activation_bytes, layer_activation_bytes, local_seq_len,
                     chunk_params, max_stage_params, state_bytes,
                     transient_activation_bytes)
from .grad_accumulation import Accumulation, accumulation
from .context_parallel import kv_exchange, step_attention_flops
from .links import Exposed
from .pipeline_step import pipeline_step_s
from .tp_overlap import overlaps as tp_overlaps, tp_overlap_exposed
from .tp_async import runs_async as tp_runs_async, tp_async_exposed

BYTES_PER_ELEMENT = 2  # bf16 activations and gradients (the default precision)
OPTIMIZER_BYTES_PER_PARAM = 16  # bf16 param + grad, fp32 master + Adam m, v
HBM_BYTES_PER_S = 3.0e12
MEGATRON_MIN_BUCKET_PARAMS = 40_000_000  # Megatron-core: max(40 M, 1 M·dp) per bucket

# Per layer, in issue order: the collectives Megatron's TP layers run.
TP_FORWARD = ("all_reduce", "all_reduce")  # after the attention and MLP row-parallel GEMMs
SP_FORWARD = ("all_gather", "reduce_scatter", "all_gather", "reduce_scatter")
TP_BACKWARD = ("all_reduce", "all_reduce")  # input grads of the column-parallel GEMMs
SP_BACKWARD = ("all_gather", "reduce_scatter", "all_gather", "reduce_scatter")
SP_ROW_BACKWARD = ("all_gather", "all_gather")  # the rest under GEMMs (async_tp_backward)


@dataclass(frozen=True)
class StageCosts:
    """What one pipeline rank's program needs to know about durations and sizes."""

    forward_chunk_s: float  # one microbatch through one model chunk
    backward_chunk_s: float
    logits_forward_s: float  # extra on the last virtual stage (output layer)
    optimizer_s: float
    activation_bytes: int  # one microbatch's boundary activation (p2p payload)
    grad_bytes: int  # this rank's gradients, reduced over dp
    tp_allreduce_bytes: int  # per microbatch and chunk, forward and backward (MegaFBD)
    params_per_rank: int
    activation_mem_bytes_per_chunk: int  # stored for backward, per microbatch
    fixed_p2p_s: float | None
    fixed_allreduce_s: float | None
    logits_backward_s: float = 0.0
    embedding_forward_s: float = 0.0  # extra on the first virtual stage
    embedding_backward_s: float = 0.0
    recompute_chunk_s: float = 0.0  # recomputation before a chunk's backward
    layers_per_chunk: int = 0
    first_layer: int = 0  # the chunk's first layer's global number
    tp_layer_forward: tuple[str, ...] = ()  # collective kinds per layer (empty at tp 1)
    tp_layer_backward: tuple[str, ...] = ()
    tp_recompute: bool = False  # full recomputation repeats the forward's collectives
    tp_bytes: int = 0  # one layer's full activation: the buffer each collective moves
    state_bytes_per_param: float = OPTIMIZER_BYTES_PER_PARAM
    transient_mem_bytes: int = 0
    recompute_layers: int = 0  # the first ones of each chunk (recompute_method: block)
    distributed_optimizer: bool = False  # reduce-scatter grads, all-gather params
    param_bytes: int = 0  # this rank's weights (all-gathered after a distributed step)
    bucket_bytes: int = 0  # gradient bucket, for overlapped reduction
    embedding_grad_bytes: int = 0  # tied embeddings on pp > 1: first/last stage all-reduce
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    p2p_all_gather: bool = False  # scatter/gather p2p: receivers all-gather over tp
    attention_share: float = 0.5  # of a layer's compute, the attention block's
    # DeepSpeed's pipeline engine (deepspeed_pipe.py): blocking sends, and the whole
    # gradient all-reduced (bf16 and fp16 ZeRO 1 alike); its accumulation pass is
    # ``accumulation``'s, as Megatron's unfused one
    deepspeed: bool = False
    # a pass after each backward where the GEMM does not accumulate (grad_accumulation.py)
    accumulation: Accumulation | None = None

    @property
    def model_mem_bytes(self) -> int:
        return int(self.params_per_rank * self.state_bytes_per_param)


@dataclass(frozen=True)
class Efficiency:
    """The device-class constants that turn FLOPs and bytes into seconds."""

    flops_per_s: float
    gemm_overhead_s: float
    module_overhead_s: float
    hbm_bytes_per_s: float
    elementwise_traffic: float
    backward_ratio: float
    gemm: GemmDevice  # GEMMs by shape
    flash_attention_flops_per_s: float | None = None  # None: the core priced as GEMMs
    kernels: KernelTable | None = None  # measured kernel rates (None: the model's)
    kernel_time_factor: float = 1.0  # a training step's kernel time over the measured

    @classmethod
    def of(cls, s: Scenario) -> "Efficiency":
        g = s.cluster.gpu
        gemm = GemmDevice(g.tflops * 1e12, g.efficiency, g.gemm_half_gflops * 1e9,
                          g.gemm_overhead_us * 1e-6, g.hbm_tbps * 1e12, g.sm_count, g.gemm_tiles)
        flash = (None if g.flash_attention_efficiency is None
                 else g.tflops * 1e12 * g.flash_attention_efficiency)
        kernels = None if g.kernels is None else load_kernel_table(g.kernels)
        return cls(g.tflops * 1e12 * g.efficiency, g.gemm_overhead_us * 1e-6,
                   g.module_overhead_us * 1e-6, g.hbm_tbps * 1e12, g.elementwise_traffic,
                   g.backward_ratio, gemm, flash, kernels, g.kernel_time_factor)

    def gemm_s(self, flops: float) -> float:
        """rate(F) = R·F/(F + R·overhead): the size-dependent falloff."""
        return flops / self.flops_per_s + self.gemm_overhead_s

    def memory_s(self, nbytes: float) -> float:
        """Element-wise work: at the bandwidth its kernels were measured to reach, else HBM's."""
        if self.kernels is not None:
            return (self.kernel_time_factor * self.elementwise_traffic * nbytes
                    / self.kernels.elementwise_bytes_per_s)
        return self.elementwise_traffic * nbytes / self.hbm_bytes_per_s

    def shape_s(self, shape: GemmShape, roofline: bool = True) -> float:
        """One GEMM by its shape: as measured where the device has a table, else modelled."""
        if self.kernels is not None:
            return self.kernel_time_factor * self.kernels.gemm_s(shape)
        return self.gemm.seconds(shape, roofline)


def rank_gemm_s(s: Scenario, eff: Efficiency) -> dict[str, float]:
    """Each of a layer's GEMMs on one rank, by its shape (``gemm.py``), the
    attention core as much of it as its kernel computes."""
    return {n: attention_core_s(s, eff, n, shape) if n in ATTENTION_CORE
            else eff.shape_s(shape, ROOFLINE[n])
            for n, shape in rank_layer_shapes(s).items()}


def attention_core_s(s: Scenario, eff: Efficiency, name: str, shape: GemmShape) -> float:
    """One of the attention core's two products, the share its kernel computes:
    flash attention at its own rate where the scenario gives one, fused and
    flash attention at the rate measured for their kernel where the device has
    a table, else as a GEMM."""
    core = computed_core_share(s)
    if s.attention_backend == "flash" and eff.flash_attention_flops_per_s is not None:
        return shape.flops * core / eff.flash_attention_flops_per_s
    measured = measured_attention_s(s, eff, shape.flops * core)
    if measured is not None:
        return measured[0]
    return eff.gemm.seconds(shape, ROOFLINE[name]) * core


def measured_attention_s(s: Scenario, eff: Efficiency,
                         flops: float) -> tuple[float, float] | None:
    """Forward and backward seconds of ``flops`` of the attention core at the
    rates measured for the scenario's kernel and shape; None where not measured
    (or the scenario sets its own flash rate)."""
    backend = s.attention_backend
    if (eff.kernels is None or not eff.kernels.covers_attention(backend)
            or (backend == "flash" and eff.flash_attention_flops_per_s is not None)):
        return None
    fwd, bwd = eff.kernels.attention_s(backend, attention_shape(s), flops)
    return eff.kernel_time_factor * fwd, eff.kernel_time_factor * bwd


def layer_forward_s(s: Scenario, eff: Efficiency) -> float:
    """One layer, one microbatch, on one rank: GEMMs split over tp·cp + elementwise work."""
    gemms = sum(rank_gemm_s(s, eff).values())
    return gemms + eff.memory_s(layer_activation_bytes(s, "none")) + eff.module_overhead_s


def layer_ring_exchange(s: Scenario, eff: Efficiency) -> Exposed:
    """Context parallelism's K/V exchange, what the attention does not hide (per layer)."""
    return kv_exchange(s, eff.gemm_s(step_attention_flops(s)), eff.backward_ratio)


def layer_tp_overlap(s: Scenario, eff: Efficiency) -> Exposed:
    """TP collectives run under GEMMs (tp_comm_overlap's, async_tp_backward's):
    what their GEMMs do not hide (per layer)."""
    gemm_s = rank_gemm_s(s, eff)
    return tp_overlap_exposed(s, gemm_s) + tp_async_exposed(s, gemm_s)


def layer_recompute_s(s: Scenario, eff: Efficiency) -> float:
    recompute = s.training.recompute
    ring = layer_ring_exchange(s, eff).forward_s  # both repeat the attention's ring
    if recompute == "full":
        return layer_forward_s(s, eff) + ring + layer_tp_overlap(s, eff).forward_s
    if recompute == "selective":
        g = rank_gemm_s(s, eff)
        return (sum(g[n] for n in ATTENTION_CORE)
                + eff.memory_s(transient_activation_bytes(s)) + ring)
    return 0.0


def scores_rebuild_s(s: Scenario, eff: Efficiency) -> float:
    """Flash and fused attention's backward computes Q·Kᵀ again from the stored
    softmax statistics (one more scores GEMM per layer); unfused keeps them.
    A measured kernel's backward is what it took beyond ``backward_ratio`` × its forward."""
    if s.stores_scores:
        return 0.0
    shapes = rank_layer_shapes(s)
    core_flops = sum(shapes[n].flops for n in ATTENTION_CORE) * computed_core_share(s)
    measured = measured_attention_s(s, eff, core_flops)
    if measured is not None:
        return measured[1] - eff.backward_ratio * measured[0]
    return rank_gemm_s(s, eff)["scores"]


def output_layer_s(s: Scenario, eff: Efficiency) -> float:
    """The logits GEMM and the loss over fp32 logits (elementwise)."""
    m = s.model
    logits_bytes = m.micro_batch_size * local_seq_len(s) * s.padded_vocab // s.parallel.tp * 4
    return (eff.shape_s(rank_logits_shape(s)) + eff.memory_s(logits_bytes)
            + eff.module_overhead_s)


def attention_share(s: Scenario, eff: Efficiency) -> float:
    """The attention block's share of a layer's GEMM time (the MLP has the rest)."""
    times = rank_gemm_s(s, eff)
    total = sum(times.values())
    return sum(times[n] for n in ATTENTION_BLOCK) / total if total > 0 else 0.5


def bucket_params(s: Scenario) -> int:
    return s.training.bucket_params or max(MEGATRON_MIN_BUCKET_PARAMS,
                                           1_000_000 * s.parallel.dp_cp)


def _tp_plan(s: Scenario) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if s.parallel.tp == 1 or tp_overlaps(s):  # overlapped: priced inside the layers
        return (), ()
    if s.sequence_parallel:
        return SP_FORWARD, (SP_ROW_BACKWARD if tp_runs_async(s) else SP_BACKWARD)
    return TP_FORWARD, (() if tp_runs_async(s) else TP_BACKWARD)


def stage_costs(s: Scenario, pp_rank: int | None = None, chunk: int = 0) -> StageCosts:
    """Model chunk ``chunk`` of pipeline stage ``pp_rank``; without a stage, the
    largest chunk (the same everywhere on an even split)."""
    p, m, c, t = s.parallel, s.model, s.costs, s.training
    eff = Efficiency.of(s)
    layers_per_chunk = (max_chunk_layers(p, m.layers) if pp_rank is None
                        else chunk_layers(p, m.layers, pp_rank, chunk))
    act_element = BYTES[t.precision]
    exposed = layer_ring_exchange(s, eff) + layer_tp_overlap(s, eff)
    fwd_layer = layer_forward_s(s, eff)
    fwd_chunk = layers_per_chunk * (fwd_layer + exposed.forward_s)
    recompute = recomputed_layers_per_chunk(s, layers_per_chunk) * layer_recompute_s(s, eff)
    logits = output_layer_s(s, eff)
    tokens = m.micro_batch_size * local_seq_len(s)
    embedding = eff.memory_s(tokens * m.hidden * BYTES[t.precision]) + eff.module_overhead_s
    bwd_chunk = (eff.backward_ratio * (layers_per_chunk * fwd_layer)
                 + layers_per_chunk * (scores_rebuild_s(s, eff) + exposed.backward_s))
    logits_bwd = eff.backward_ratio * logits
    if c.forward_s is not None:
        fwd_chunk, logits, recompute, logits_bwd = c.forward_s / p.vpp, 0.0, 0.0, 0.0
        bwd_chunk, embedding = 2 * fwd_chunk, 0.0
    if c.backward_s is not None:
        bwd_chunk, logits_bwd = c.backward_s / p.vpp, 0.0
    params = max_stage_params(s)
    per_param = state_bytes(t, p.dp_cp)
    act = tokens * m.hidden * act_element
    # Adam is memory-bound: read and write every state byte of the shard it updates.
    shard = params / p.dp_cp if t.distributed_optimizer else params
    full_state = per_param.weights + per_param.grads + state_bytes(t, 1).optimizer
    optimizer = 0.0 if c.forward_s is not None else 2 * shard * full_state / eff.hbm_bytes_per_s
    if c.optimizer_s is not None:
        optimizer = c.optimizer_s
    tp_fwd, tp_bwd = _tp_plan(s)
    tied = not m.untie_embeddings and p.pp > 1
    scatter_gather = p.scatter_gather_p2p and p.tp > 1 and not s.sequence_parallel
    message = act // p.tp if (s.sequence_parallel or scatter_gather) else act
    step = pipeline_step_s(s, message)  # fixed costs (``costs:``) hold the exchange too
    fwd_chunk += step if c.forward_s is None else 0.0
    bwd_chunk += step if c.forward_s is None and c.backward_s is None else 0.0
    # The accumulation pass is compute: fixed costs (``costs:``) hold it
    accumulated = 0 if c.forward_s is not None else (
        params // p.vpp if pp_rank is None else chunk_params(s, pp_rank, chunk))
    return StageCosts(
        forward_chunk_s=fwd_chunk,
        backward_chunk_s=bwd_chunk,
        logits_forward_s=logits,
        optimizer_s=optimizer,
        activation_bytes=message,
        grad_bytes=int(params * per_param.grads),
        tp_allreduce_bytes=2 * layers_per_chunk * act if p.tp > 1 else 0,
        params_per_rank=params,
        activation_mem_bytes_per_chunk=int(chunk_activation_bytes(s, layers_per_chunk)),
        fixed_p2p_s=c.p2p_s,
        fixed_allreduce_s=c.allreduce_s,
        logits_backward_s=logits_bwd,
        embedding_forward_s=embedding,
        embedding_backward_s=eff.backward_ratio * embedding,
        recompute_chunk_s=recompute,
        recompute_layers=recomputed_layers_per_chunk(s, layers_per_chunk),
        layers_per_chunk=layers_per_chunk,
        first_layer=0 if pp_rank is None else first_layer(p, m.layers, pp_rank, chunk),
        tp_layer_forward=tp_fwd,
        tp_layer_backward=tp_bwd,
        tp_recompute=t.recompute == "full",
        tp_bytes=act,
        state_bytes_per_param=per_param.total,
        transient_mem_bytes=int(transient_activation_bytes(s)),
        distributed_optimizer=t.distributed_optimizer,
        param_bytes=int(params * per_param.weights),
        bucket_bytes=int(bucket_params(s) * per_param.grads),
        embedding_grad_bytes=int(s.padded_vocab * m.hidden // p.tp * per_param.grads) if tied else 0,
        overlap_grad_reduce=t.overlap_grad_reduce,
        overlap_param_gather=t.overlap_param_gather,
        p2p_all_gather=scatter_gather,
        attention_share=attention_share(s, eff),
        deepspeed=p.pipeline_engine == "deepspeed",
        accumulation=accumulation(s, accumulated, eff.hbm_bytes_per_s),
    )
