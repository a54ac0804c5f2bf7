"""Scenario files: a validated schema, dotted overrides and one-line errors.

A scenario is the single input that every backend runs unchanged. Errors are
reported as ``ScenarioError(field, reason)`` so the CLI can print one line and
exit with status 2.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, AliasChoices, Field, SerializeAsAny, ValidationError,
                      field_validator, model_validator)

from ..io import gate
from ..io.schema import (MAX_COUNT, MAX_DRIFT_PPM, MAX_FACTOR, MAX_OFFSET_US, MAX_RATE,  # noqa: F401
                         MAX_SECONDS, Factor, NotANumber as _NotANumber, PositiveInt, Rank, Rate,
                         OmitsUnset as _OmitsUnset, ScenarioError, Seconds,
                         StrictModel as _Strict, validation_error)
from ..io.text import TextError, check_depth, load_yaml

from . import seeds
from .devices import DEVICES, expand_device
from . import megatron_defaults
from .software import SOFTWARE
from ..faults import FaultSpec, Job, check_faults, parse_faults
from ..parallel.topology import Topology
from ..parallel.schedules import SCHEDULES
from ..io.suggest import hint
from .pipeline_split import is_default, max_chunk_layers, split_error
from .scope_spec import PERTURBATION_KINDS, ModelShape, Scope, check_against_model


NAME_MAX = 100


def _safe_name(name: str) -> str:
    """The scenario name becomes a directory name: one plain path component."""
    if not name or name in (".", "..") or name.startswith("."):
        raise ValueError(f"{name!r} cannot be a directory name (empty, '.', '..' or hidden)")
    if any(c in name for c in "/\\") or not name.isprintable() or len(name) > NAME_MAX:
        raise ValueError(f"{name[:40]!r} must be one printable file name of at most "
                         f"{NAME_MAX} characters, without '/' or '\\'")
    return name


SafeName = Annotated[str, AfterValidator(_safe_name)]


class Parallel(_OmitsUnset):
    tp: PositiveInt = 1
    pp: PositiveInt = 1
    dp: PositiveInt = 1
    vpp: PositiveInt = 1
    microbatches: PositiveInt = 1
    microbatch_group_size: PositiveInt | None = None  # Megatron's default: pp
    sequence_parallel: bool = False  # Megatron turns it off at tp = 1 (see adjustments)
    # Megatron-LM 2021's scatter/gather of pipeline messages: each tp rank sends
    # 1/tp of the activation, the receiver all-gathers it over the tp group.
    scatter_gather_p2p: bool = False
    # Uneven pipeline splits (megatron-core's num_layers_in_first/last_pipeline_stage;
    # scenario/pipeline_split.py): the first / last stage's layers, the rest even.
    decoder_first_pipeline_num_layers: PositiveInt | None = None
    decoder_last_pipeline_num_layers: PositiveInt | None = None
    account_for_embedding_in_pipeline_split: bool = False  # the embedding counts as a layer
    account_for_loss_in_pipeline_split: bool = False  # the output layer and loss count as one
    # Context parallelism (megatron-core's context_parallel_size): each of cp ranks
    # holds 1/cp of every sequence; ranks are ordered tp, cp, dp, pp as Megatron's.
    context_parallel_size: PositiveInt = 1
    # megatron-core's cp_comm_type: p2p passes K and V round a ring under the
    # attention; all_gather gathers them all first. Unset: p2p.
    cp_comm_type: Literal["p2p", "all_gather"] | None = None
    # Megatron's tp_comm_overlap: sequence-parallel collectives under the GEMMs
    # (costs/tp_overlap.py); Megatron-LM accepts it with sequence parallelism only.
    tp_comm_overlap: bool = False
    # Megatron-LM since 2022 (megatron-core too): the column-parallel layers' backward
    # all-reduce (async_tensor_model_parallel_allreduce) or, with sequence parallelism,
    # reduce-scatter and input re-gather run under their GEMMs (costs/tp_async.py).
    # Unset: on where the software is megatron-core's (Scenario.async_tp_backward).
    async_tp_backward: bool | None = None
    # Whose pipeline engine runs the schedule: Megatron's, or DeepSpeed's PipelineEngine
    # (Megatron-DeepSpeed; costs/deepspeed_pipe.py prices what it does differently).
    pipeline_engine: Literal["megatron", "deepspeed"] = "megatron"
    OMIT_WHEN_UNSET = ("tp_comm_overlap", "async_tp_backward", "pipeline_engine", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                       "account_for_embedding_in_pipeline_split",
                       "account_for_loss_in_pipeline_split", "context_parallel_size",
                       "cp_comm_type")

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def dp_cp(self) -> int:
        """Megatron's data-parallel group with context parallelism: gradients are
        reduced (and a distributed optimizer sharded) over dp·cp ranks."""
        return self.dp * self.cp

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def group_size(self) -> int:
        return self.microbatch_group_size or self.pp


class Model(_OmitsUnset):
    layers: PositiveInt = 8
    hidden: PositiveInt = 1024
    heads: PositiveInt = 16
    seq_len: PositiveInt = 1024
    vocab: PositiveInt = 32000
    micro_batch_size: PositiveInt = 1
    # Megatron's name; ``ffn_hidden`` is still accepted. Default 4·hidden
    # (gelu) or Megatron's swiglu default, 8·hidden/3 rounded down to 64.
    ffn_hidden: PositiveInt | None = Field(
        None, validation_alias=AliasChoices("ffn_hidden_size", "ffn_hidden"))
    num_query_groups: PositiveInt | None = None  # grouped-query attention; default heads
    activation: Literal["gelu", "swiglu"] = "gelu"
    # Megatron's --openai-gelu: gelu's tanh approximation (GPT-2's "gelu_new")
    openai_gelu: bool = False
    untie_embeddings: bool = False  # Megatron ties input embedding and output layer
    # megatron-core's AttnBackend (transformer/enums.py): unfused (DotProductAttention)
    # stores the a·s² scores; flash and fused (TEDotProductAttention) keep only the
    # softmax statistics and rebuild the scores in backward. Unset: auto, as Megatron's
    # --attention-backend (Scenario.attention_backend says what it picks).
    attention_backend: Literal["auto", "unfused", "flash", "fused"] | None = None
    # megatron-core's position_embedding_type: only learned_absolute has weights
    # (seq_len·hidden on the first stage); rope and none have none. Unset: learned_absolute.
    position_embedding_type: Literal["learned_absolute", "rope", "none"] | None = None
    # Megatron's --make-vocab-size-divisible-by: the vocabulary is padded to a multiple of
    # this × tp (Scenario.padded_vocab); 1 to a multiple of tp alone.
    make_vocab_size_divisible_by: PositiveInt = 128
    # Megatron's --hidden-dropout and --attention-dropout (0.1): a layer keeps 1-byte
    # masks for backward only where they are above 0 (costs/memory.py).
    hidden_dropout: float = Field(0.1, ge=0, lt=1)
    attention_dropout: float = Field(0.1, ge=0, lt=1)
    OMIT_WHEN_UNSET = ("attention_backend", "position_embedding_type",
                       "make_vocab_size_divisible_by", "openai_gelu", "hidden_dropout",
                       "attention_dropout")

    @property
    def position_embedding_params(self) -> int:
        learned = self.position_embedding_type in (None, "learned_absolute")
        return self.seq_len * self.hidden if learned else 0

    @property
    def ffn(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        if self.activation == "swiglu":
            return int(4 * self.hidden * 2 / 3 / 64) * 64
        return 4 * self.hidden

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.heads


class Gpu(_OmitsUnset):
    # The named device (scenario/devices.py) and its software generation
    # (scenario/software.py; unset: Megatron-Core 0.16): which Megatron defaults and
    # which fitted constants apply. Unset device: a GPU described by the keys below.
    device: str | None = None
    software: str | None = None
    architecture: Literal["ampere", "hopper"] | None = None  # Transformer Engine's kernel choice
    tflops: Rate = 400.0
    memory_gb: Rate = 80.0
    efficiency: float = Field(0.5, gt=0, le=1)  # achieved share of peak FLOPs on large GEMMs
    # The efficiency model (docs/pricing.md), calibrated by ``megatronapp calibrate``:
    gemm_overhead_us: Seconds = 0.0  # fixed time per GEMM: small GEMMs run slower
    module_overhead_us: Seconds = 0.0  # per layer, embedding and output-layer call
    hbm_tbps: Rate = 3.0  # memory bandwidth (elementwise work, optimizer)
    elementwise_traffic: float = Field(0.0, ge=0, le=MAX_FACTOR)  # HBM bytes per activation byte
    backward_ratio: Factor = 2.0  # backward time / forward time (FLOPs: 2)
    op_overhead_us: Seconds = 0.0  # host time to issue each operation
    # GEMMs by shape (megatronapp/costs/gemm.py): SMs and output tiles give wave
    # quantisation and the roofline; unset (no geometry) every GEMM runs at ``efficiency``.
    sm_count: PositiveInt | None = None
    gemm_tiles: tuple[tuple[PositiveInt, PositiveInt], ...] = ((256, 128), (128, 256), (128, 128))
    gemm_half_gflops: float = Field(0.0, ge=0, le=MAX_RATE)  # GEMM size at half the efficiency
    # Share of peak flash attention's core reaches where it is not a GEMM's (FlashAttention-2
    # on Hopper); None: priced as GEMMs of its shape, as unfused and fused attention are.
    flash_attention_efficiency: float | None = Field(None, gt=0, le=1)
    # Kernel times measured on the device (megatronapp/costs/kernels.py): GEMMs, fused and
    # flash attention and element-wise work at their measured rates; None: the model above.
    kernels: Literal["h100-sxm", "h200-sxm"] | None = None
    kernel_time_factor: Factor = 1.0  # a training step's kernel time over the measured
    # Megatron-core's pipeline exchange (costs/pipeline_step.py): what one point-to-point
    # operation costs beyond its bytes; None: messages move eagerly, as before.
    p2p_op_us: Seconds | None = None
    OMIT_WHEN_UNSET = ("device", "software", "architecture", "p2p_op_us")

    def _kept_when_unset(self) -> set[str]:
        # unset on a named device means eager messages, not the device's fitted value
        return {"p2p_op_us"} if self.device is not None else set()

    @field_validator("software")
    @classmethod
    def _known_software(cls, value: str | None) -> str | None:
        if value is not None and value not in SOFTWARE:
            raise ValueError(f"unknown software {value!r}; " + hint(value, SOFTWARE, "generations"))
        return value


class Links(_Strict):
    intra_node_gbps: Rate = 2400.0  # GB/s·8, i.e. Gbit/s
    inter_node_gbps: Rate = 400.0
    latency_us: float = Field(5.0, ge=0, le=MAX_SECONDS)
    intra_node_latency_us: Seconds | None = None  # default latency_us
    inter_node_latency_us: Seconds | None = None
    # A collective spanning nodes with k members on each node drives min(k, nics)
    # NICs at once (NCCL's rings); None: one NIC's bandwidth, as a single ring.
    nics_per_node: PositiveInt | None = None


class NetworkTopology(_Strict):
    """Nodes in pods (rail-optimised within: each GPU's NIC on its rail's leaf
    switch); traffic between pods crosses spine uplinks oversubscribed
    ``oversubscription``:1 (Llama 3's cluster: 7 between pods)."""

    pod_nodes: PositiveInt | None = None  # None: one pod (no uplinks crossed)
    oversubscription: Factor = 1.0


class Jitter(_Strict):
    """Background noise everywhere (healthy-run controls): lognormal sigmas."""

    compute_sigma: float = Field(0.0, ge=0, le=1)
    link_sigma: float = Field(0.0, ge=0, le=2)


class DeviceClass(_Strict):
    """A kind of device in a heterogeneous cluster (MegaFBD)."""

    name: str
    count: PositiveInt
    tflops: Rate
    memory_gb: Rate


class Fbd(_Strict):
    """MegaFBD placement (physical forward TP degree and device classes) and
    the coordinator's pace: a control thread whose round ran nothing naps
    ``round_nap_s`` before the next (rounds are all-reduces; back to back
    they would take the CPU from the workers)."""

    forward_tp: PositiveInt | None = None  # default: the virtual tp
    forward_class: str | None = None  # default: the first device class
    backward_class: str | None = None
    round_nap_s: float = Field(1e-3, ge=0, le=1)


class Cluster(_Strict):
    gpus_per_node: PositiveInt = 8
    nodes: PositiveInt | None = None  # if given, must hold exactly tp·pp·dp GPUs
    gpu: Gpu = Gpu()
    links: Links = Links()
    network: NetworkTopology = NetworkTopology()
    jitter: Jitter = Jitter()
    device_classes: tuple[DeviceClass, ...] = ()  # MegaFBD heterogeneous clusters

    @model_validator(mode="before")
    @classmethod
    def _named_device(cls, data: Any) -> Any:
        """``gpu: NAME`` or ``gpu: {device: NAME, ...}`` takes a device profile
        (megatronapp/devices); the scenario's own keys win."""
        gpu = data.get("gpu") if isinstance(data, dict) else None
        if isinstance(gpu, str):
            gpu = {"device": gpu}
        if not isinstance(gpu, dict) or "device" not in gpu:
            return data
        name = gpu["device"]
        if not isinstance(name, str) or name not in DEVICES:
            raise ScenarioError("cluster.gpu.device", f"unknown device {name!r}; "
                                + hint(str(name), DEVICES, "devices"))
        if not isinstance(data.get("links", {}), dict):
            raise ScenarioError("cluster.links", "must be a mapping")
        return expand_device({**data, "gpu": gpu}, DEVICES[name])


class Costs(_Strict):
    """Fixed durations replacing the analytical cost model (calibration, exact tests)."""

    forward_s: Seconds | None = None
    backward_s: Seconds | None = None
    p2p_s: Seconds | None = None
    allreduce_s: Seconds | None = None
    optimizer_s: Seconds | None = None


class Dpp(_Strict):
    """Knobs of the adaptive (MegaDPP) schedule."""

    traversal: Literal["breadth", "depth"] = "breadth"  # preferred order among ready tasks
    max_pending_sends: PositiveInt = 2  # a link with this many messages in flight is congested


class Data(_Strict):
    """What the torch backend trains on (the simulator only needs sizes)."""

    kind: Literal["text", "random"] = "text"  # text: character-level windows of ``path``
    path: str | None = None  # a UTF-8 text file; default CPython's pydoc_data/topics.py


class Training(_OmitsUnset):
    """How a run trains: the torch backend's optimizer and checkpoint, and
    Megatron-core's options that change time and memory (docs/fidelity.md)."""

    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = Field(1e-3, gt=0)
    checkpoint: bool = False  # save the trained model under RUN_DIR/checkpoint/
    # activation recomputation; true / false (older scenarios) read as full / none
    recompute: Literal["none", "selective", "full"] = "none"
    # Megatron-core's partial full recomputation (TransformerBlock._checkpointed_forward):
    # block recomputes the first recompute_num_layers layers of each model chunk and
    # stores the rest; uniform checkpoints the input of every group of that many
    # layers and recomputes them all. Unset: every layer checkpointed on its own.
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: PositiveInt | None = None
    OMIT_WHEN_UNSET = ("recompute_method", "recompute_num_layers", "gradient_accumulation_fusion",
                       "grad_reduce_in_fp32")
    distributed_optimizer: bool = False  # optimizer state (and grad reduce) sharded over dp
    overlap_grad_reduce: bool = False  # bucketed dp reduce overlapped with the last backward
    overlap_param_gather: bool = False  # param all-gather overlapped with the next forward
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"  # parameters and activations
    # fp32 main gradients; unset: Megatron-LM's rule, on with bf16 (Scenario.grad_reduce_in_fp32)
    grad_reduce_in_fp32: bool | None = None
    # Megatron-LM's --no-gradient-accumulation-fusion (before 2022 there was no fusion):
    # false, a pass after each backward folds the gradients in (costs/grad_accumulation.py)
    gradient_accumulation_fusion: bool = True
    bucket_params: PositiveInt | None = None  # default Megatron's max(40 M, 1 M·dp)

    @property
    def grads_in_fp32(self) -> bool:
        """grad_reduce_in_fp32, or Megatron-LM's rule for it: bf16 accumulates and reduces
        gradients in fp32 (megatron/training/arguments.py, megatron_defaults.py)."""
        return (self.grad_reduce_in_fp32 if self.grad_reduce_in_fp32 is not None
                else self.precision == "bf16")

    @field_validator("recompute", mode="before")
    @classmethod
    def _recompute_as_bool(cls, value: Any) -> Any:
        flag = value.value if isinstance(value, _NotANumber) else value
        if isinstance(flag, bool):
            return "full" if flag else "none"
        return value


class Mitigation(_OmitsUnset):
    """The closed loop (megatronapp/mitigate): what a run does when on-line
    MegaScan names a slow rank or link, or a fail-stop fault stops it."""

    action: Literal["none", "exclude"] = "none"  # exclude: drop the node, or swap in a spare
    min_confidence: float = Field(0.5, ge=0, le=1)  # verdicts below it are reported, not acted on
    hold_iterations: PositiveInt = 1  # act at the boundary this many iterations after the verdict
    restart_s: Seconds = 60.0  # stopping, rescheduling, reloading the checkpoint
    checkpoint_every: PositiveInt = 1  # iterations between checkpoints (a restart redoes the rest)
    spares: Annotated[int, Field(ge=0, le=MAX_COUNT)] = 0  # spare nodes swapped in first
    checkpoint_s: Seconds = 0.0  # writing one checkpoint (training waits for it)
    # act only on a verdict whose re-planned job is predicted faster per iteration
    # than staying: the iteration less the cause's cost, on the plan's layout
    only_if_faster: bool = False
    OMIT_WHEN_UNSET = ("checkpoint_s", "only_if_faster")


class Scenario(_OmitsUnset):
    name: SafeName = "scenario"
    seed: int = 0  # any integer (megatronapp.scenario.seeds maps it for numpy and torch)
    iterations: PositiveInt = 1
    schedule: Literal[SCHEDULES] = "1f1b"  # type: ignore[valid-type]
    parallel: Parallel = Parallel()
    model: Model = Model()
    cluster: Cluster = Cluster()
    costs: Costs = Costs()
    fbd: Fbd | None = None  # present: ``run`` trains decoupled (MegaFBD)
    faults: tuple[SerializeAsAny[FaultSpec], ...] = ()  # each kind: megatronapp/faults
    allow_idle_faults: bool = False  # accept faults that change nothing in this job
    dpp: Dpp = Dpp()
    data: Data = Data()
    training: Training = Training()
    scope: Scope | None = None  # MegaScope: observations and perturbations
    mitigation: Mitigation | None = None  # the closed loop: act on on-line verdicts
    OMIT_WHEN_UNSET = ("allow_idle_faults",)

    @field_validator("faults", mode="before")
    @classmethod
    def _fault_kinds(cls, value: Any) -> Any:
        return parse_faults(value)

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def padded_vocab(self) -> int:
        """The vocabulary as Megatron builds its embedding and output layer:
        padded to a multiple of make_vocab_size_divisible_by × tp
        (megatron/training/tokenizer/tokenizer.py ``_vocab_size_with_padding``;
        Megatron-DeepSpeed's the same), so that each tp rank's share is aligned."""
        multiple = self.model.make_vocab_size_divisible_by * self.parallel.tp
        return -(-self.model.vocab // multiple) * multiple

    @property
    def sequence_parallel(self) -> bool:
        """Effective sequence parallelism: Megatron disables it at tp = 1."""
        return self.parallel.sequence_parallel and self.parallel.tp > 1

    @property
    def attention_backend(self) -> str:
        """The attention kernel that runs: model.attention_backend, or what auto picks."""
        return megatron_defaults.attention_backend(self)

    @property
    def stores_scores(self) -> bool:
        """Unfused attention keeps the a·s² scores for backward; flash and fused do not."""
        return self.attention_backend == "unfused"

    @property
    def grad_reduce_in_fp32(self) -> bool:
        return self.training.grads_in_fp32

    @property
    def async_tp_backward(self) -> bool:
        return megatron_defaults.async_tp_backward(self)

    @model_validator(mode="after")
    def _consistent(self) -> "Scenario":
        check_consistency(self)
        return self


def check_consistency(s: Scenario) -> None:
    """Cross-field rules; raise ScenarioError naming the field."""
    p, m = s.parallel, s.model
    world = device_count(s)  # fault ranks are physical devices
    if s.cluster.nodes is not None and s.cluster.nodes * s.cluster.gpus_per_node != world:
        raise ScenarioError(
            "parallel", f"{'MegaFBD needs' if s.fbd else _world_formula(p)} {world} devices but "
            f"cluster has {s.cluster.nodes}*{s.cluster.gpus_per_node} GPUs")
    split = split_error(p, m.layers)
    if split is not None:
        raise ScenarioError(*split)
    if m.heads % p.tp:
        raise ScenarioError("model.heads", f"{m.heads} is not divisible by tp = {p.tp}")
    if m.hidden % m.heads:
        raise ScenarioError("model.hidden", f"{m.hidden} is not divisible by heads = {m.heads}")
    if p.vpp > 1 and s.schedule in ("gpipe", "1f1b"):
        raise ScenarioError("parallel.vpp", f"vpp = {p.vpp} needs an interleaved schedule, not {s.schedule}")
    grouped = s.schedule in ("interleaved", "dfc")  # bfc and adaptive need no groups
    if p.vpp > 1 and grouped and p.microbatches % p.group_size:
        raise ScenarioError(
            "parallel.microbatches",
            f"{p.microbatches} is not divisible by microbatch_group_size = {p.group_size}")
    if p.vpp > 1 and grouped and p.group_size < p.pp:
        raise ScenarioError(
            "parallel.microbatch_group_size", f"{p.group_size} is smaller than pp = {p.pp}")
    _check_megatron_options(s)
    check_faults(s.faults, fault_job(s))
    _check_fbd(s)
    _check_scope(s)
    if s.mitigation is not None and s.mitigation.action != "none" and s.fbd is not None:
        # action none only reports: nothing runs beside MegaFBD's decoupled ranks
        raise ScenarioError("mitigation.action", f"{s.mitigation.action}: the closed loop does "
                            "not run with an fbd section (MegaFBD); use action: none, or drop fbd")


def _world_formula(p: Parallel) -> str:
    return "tp*cp*pp*dp =" if p.cp > 1 else "tp*pp*dp ="


def _check_scope(s: Scenario) -> None:
    if s.scope is None:
        return
    if s.fbd is not None:
        raise ScenarioError("scope", "MegaScope does not run together with an fbd section")
    if not is_default(s.parallel):
        raise ScenarioError("scope", "MegaScope maps layers to stages evenly: it does not run "
                            "with an uneven pipeline split")
    p, m = s.parallel, s.model
    bad = check_against_model(s.scope, ModelShape(
        layers=m.layers, heads=m.heads, hidden=m.hidden, ffn=m.ffn, vocab=m.vocab,
        seq_len=m.seq_len, tp=p.tp, pp_vpp=p.pp * p.vpp))
    if bad is not None:
        raise ScenarioError(*bad)


def _check_megatron_options(s: Scenario) -> None:
    """The combinations Megatron-LM itself rejects (its arguments.py asserts)."""
    p, m, t = s.parallel, s.model, s.training
    if m.heads % m.query_groups:
        raise ScenarioError("model.num_query_groups",
                            f"{m.query_groups} does not divide heads = {m.heads}")
    if m.query_groups % p.tp:
        raise ScenarioError("model.num_query_groups",
                            f"{m.query_groups} is not divisible by tp = {p.tp}")
    if m.ffn % p.tp:
        raise ScenarioError("model.ffn_hidden_size", f"{m.ffn} is not divisible by tp = {p.tp}")
    if s.sequence_parallel and m.seq_len % p.tp:
        raise ScenarioError("model.seq_len", f"{m.seq_len} is not divisible by tp = {p.tp} "
                            "(sequence parallelism splits the sequence)")
    _check_context_parallel(s)
    if p.tp_comm_overlap and not s.sequence_parallel:
        raise ScenarioError("parallel.tp_comm_overlap", "needs parallel.sequence_parallel and "
                            "tp > 1 (Megatron-LM rejects it too)")
    if t.overlap_param_gather and not t.distributed_optimizer:
        raise ScenarioError("training.overlap_param_gather",
                            "needs training.distributed_optimizer (Megatron-LM rejects it too)")
    if t.overlap_param_gather and not t.overlap_grad_reduce:
        raise ScenarioError("training.overlap_param_gather",
                            "needs training.overlap_grad_reduce (Megatron-LM rejects it too)")
    _check_recompute_method(s)
    _check_pipeline_engine(s)
    if t.grad_reduce_in_fp32 and t.precision == "fp32":
        raise ScenarioError("training.grad_reduce_in_fp32",
                            "only applies to bf16/fp16 training (precision is fp32)")


def _check_context_parallel(s: Scenario) -> None:
    """megatron-core splits each sequence into 2·cp chunks (utils.get_batch_on_this_cp_rank),
    runs context parallelism in TEDotProductAttention only (dot_product_attention.py
    asserts cp == 1), and sequence parallelism then splits each rank's part over tp."""
    p, m = s.parallel, s.model
    if p.cp == 1:
        return
    if s.stores_scores:
        raise ScenarioError("parallel.context_parallel_size", "needs model.attention_backend: "
                            "flash or fused (megatron-core runs it in TEDotProductAttention only)")
    if m.seq_len % (2 * p.cp) or (s.sequence_parallel and m.seq_len // p.cp % p.tp):
        raise ScenarioError("model.seq_len", f"{m.seq_len} is not divisible by 2·cp = {2 * p.cp}"
                            + (f" and then by tp = {p.tp}" if s.sequence_parallel else ""))
    if s.fbd is not None:
        raise ScenarioError("parallel.context_parallel_size", "MegaFBD runs without it")


def _check_pipeline_engine(s: Scenario) -> None:
    """DeepSpeed's PipelineEngine runs one schedule (runtime/pipe/schedule.py's
    TrainSchedule: 1F1B, one model chunk per stage) and reduces gradients after
    the pipeline flush (engine.py's ReduceGrads step), never under the backward."""
    if s.parallel.pipeline_engine != "deepspeed":
        return
    if s.schedule != "1f1b" or s.parallel.vpp > 1:
        raise ScenarioError("parallel.pipeline_engine",
                            "deepspeed runs schedule 1f1b with vpp 1 only (its TrainSchedule)")
    if s.training.overlap_grad_reduce:
        raise ScenarioError("parallel.pipeline_engine", "deepspeed reduces gradients after the "
                            "pipeline flush (training.overlap_grad_reduce must be false)")


def _check_recompute_method(s: Scenario) -> None:
    """megatron-core's TransformerConfig.__post_init__ rules for partial recomputation."""
    t, p = s.training, s.parallel
    if t.recompute_method is None and t.recompute_num_layers is None:
        return
    if t.recompute != "full":
        field = "recompute_method" if t.recompute_method else "recompute_num_layers"
        raise ScenarioError(f"training.{field}", "applies to training.recompute: full only")
    if t.recompute_method is None:
        raise ScenarioError("training.recompute_method",
                            "uniform or block is needed with training.recompute_num_layers")
    per_chunk = max_chunk_layers(p, s.model.layers)
    if t.recompute_num_layers is None or t.recompute_num_layers > per_chunk:
        raise ScenarioError("training.recompute_num_layers",
                            f"must be between 1 and the layers per model chunk, {per_chunk}")


def adjustments(s: Scenario) -> list[str]:
    """Settings Megatron-LM silently changes, applied here the same way."""
    notes = []
    if s.parallel.sequence_parallel and not s.sequence_parallel:
        notes.append("parallel.sequence_parallel is off: tp = 1 "
                     "(Megatron-LM disables sequence parallelism without tensor parallelism)")
    return notes


def _check_fbd(s: Scenario) -> None:
    names = [c.name for c in s.cluster.device_classes]
    if len(set(names)) != len(names):
        raise ScenarioError("cluster.device_classes", "device class names must be unique")
    if s.fbd is not None and not is_default(s.parallel):
        raise ScenarioError("fbd", "MegaFBD runs an even pipeline split only")
    f = s.fbd or Fbd()
    if f.forward_tp is not None and s.parallel.tp % f.forward_tp:
        raise ScenarioError("fbd.forward_tp",
                            f"{f.forward_tp} does not divide the virtual tp = {s.parallel.tp}")
    for key in ("forward_class", "backward_class"):
        name = getattr(f, key)
        if name is not None and name not in names:
            raise ScenarioError(f"fbd.{key}", f"unknown device class {name!r} "
                                f"(cluster.device_classes has {names or 'none'})")


def device_count(s: Scenario) -> int:
    """Physical devices of the job: tp*pp*dp, or with an ``fbd`` section the
    forward instance (physical tp ``forward_tp``) plus the backward instance."""
    p = s.parallel
    if s.fbd is None or p.cp > 1:  # cp > 1 with fbd: reported as parallel.context_parallel_size
        return p.world_size
    forward_tp = s.fbd.forward_tp or p.tp
    if p.tp % forward_tp:
        return p.world_size  # reported as fbd.forward_tp by _check_fbd
    return p.pp * p.dp * (forward_tp + p.tp)


def fault_job(s: Scenario) -> Job:
    """What the scenario's faults need to know of its job."""
    p = s.parallel
    return Job(Topology(tp=p.tp, pp=p.pp, dp=p.dp_cp, gpus_per_node=s.cluster.gpus_per_node),
               s.iterations, tuple(seeds.entropy(s.seed)), p.vpp, p.cp,
               not s.model.untie_embeddings, device_count(s) if s.fbd is not None else None,
               s.allow_idle_faults)


# ---------------------------------------------------------------- loading


def _error_from_validation(err: ValidationError) -> ScenarioError:
    return validation_error(err, Scenario, tags=PERTURBATION_KINDS, what="perturbation")


def parse_scenario(data: Any) -> Scenario:
    if not isinstance(data, dict):
        raise ScenarioError("scenario", "top level must be a mapping")
    try:
        check_depth(data, "the scenario")  # also what --set built
    except TextError as err:
        raise ScenarioError("scenario", str(err)) from None
    try:
        return Scenario.model_validate(data)
    except ValidationError as err:
        raise _error_from_validation(err) from None


def _parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ScenarioError("--set", f"expected dotted.key=value, got {text!r}")
    try:
        value = load_yaml(raw, "value") if raw.strip() else None
    except TextError as err:
        if "nested" in str(err) or "duplicate" in str(err):
            raise ScenarioError(f"--set {key.strip()}", str(err)) from None
        value = raw  # not YAML: take it as text
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``dotted.key=value`` applied."""
    import copy

    out = copy.deepcopy(data)  # read_scenario_data bounded its depth
    for text in overrides:
        path, value = _parse_override(text)
        if path[:2] == ["cluster", "gpu"] and len(path) > 2:
            _expand_named_gpu(out)
        node: Any = out
        for i, part in enumerate(path[:-1]):
            nxt = _child(node, part, ".".join(path[: i + 1]))
            if nxt is None:
                nxt = {}
                _assign(node, part, nxt, ".".join(path[: i + 1]))
            node = nxt
        _assign(node, path[-1], value, ".".join(path))
    return out


def _expand_named_gpu(data: dict[str, Any]) -> None:
    """``cluster.gpu: NAME`` as ``{device: NAME}``, so that ``--set`` can set a
    key beside the device (the validator reads both forms alike)."""
    cluster = data.get("cluster")
    if isinstance(cluster, dict) and isinstance(cluster.get("gpu"), str):
        cluster["gpu"] = {"device": cluster["gpu"]}


def _child(node: Any, part: str, where: str) -> Any:
    if isinstance(node, list):
        idx = _index(part, where, len(node))
        return node[idx]
    if not isinstance(node, dict):
        raise ScenarioError(where, "cannot descend into a scalar")
    return node.get(part)


def _assign(node: Any, part: str, value: Any, where: str) -> None:
    if isinstance(node, list):
        node[_index(part, where, len(node))] = value
    elif isinstance(node, dict):
        node[part] = value
    else:
        raise ScenarioError(where, "cannot set a key inside a scalar")


def _index(part: str, where: str, size: int) -> int:
    if not part.isdigit() or int(part) >= size:
        raise ScenarioError(where, f"no list element {part!r}")
    return int(part)


def read_scenario_data(path: str | Path) -> dict[str, Any]:
    """The mapping in a UTF-8 YAML file; an empty file is an error, not the defaults."""
    path = Path(path)
    try:
        if gate.exists(path, "", "any") and path.is_dir():
            raise ScenarioError("scenario", _what_directory(path))
        data = load_yaml(gate.read_text(path, "", gate.MAX_TEXT_BYTES), str(path))
    except TextError as err:
        raise ScenarioError("scenario", str(err)) from None
    if isinstance(data, dict) and "traceEvents" in data:
        raise ScenarioError("scenario", f"{path} is a trace, not a scenario; did you mean "
                            f"`megatronapp detect {path}`?")
    if data is None:
        raise ScenarioError("scenario", f"{path} is empty (an empty scenario would silently "
                            "run the defaults; write at least a name)")
    if not isinstance(data, dict):
        raise ScenarioError("scenario", f"{path} must hold a mapping at the top level")
    return data


def _what_directory(path: Path) -> str:
    """Why a directory is no scenario, and the command it was probably meant for."""
    if (path / "summary.json").is_file() or (path / "trace.parquet").is_file():
        return (f"{path} is a run directory; `run` takes a scenario file (.yaml) — did you "
                f"mean `megatronapp detect {path}`?")
    return f"{path} is a directory; `run` takes a scenario file (.yaml)"


def default_name(path: str | Path) -> str:
    """The file's stem, when it makes a safe directory name."""
    try:
        return _safe_name(Path(path).stem)
    except ValueError:
        return "scenario"


def load_scenario(path: str | Path, overrides: list[str] | None = None) -> Scenario:
    data = read_scenario_data(path)
    data.setdefault("name", default_name(path))
    return parse_scenario(apply_overrides(data, overrides or []))


def scenario_to_dict(s: Scenario) -> dict[str, Any]:
    return s.model_dump(mode="json")
