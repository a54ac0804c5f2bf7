"""Everything about what a key left unset means lives here: Megatron-core's defaults.

A scenario key the user does not write means what the Megatron-core argument it
mirrors means when that argument is not given, for the software the scenario
runs (``software.py``; Megatron-Core 0.16 unless ``cluster.gpu.software`` names
another). ``DEFAULTS`` is the one table: each row names the scenario key, the
Megatron-LM argument (or megatron-core field) it mirrors, what Megatron does
without it, and where that is written, as ``file:line`` at the tag
``core_v0.16.1`` of NVIDIA/Megatron-LM (``core_r0.8.0`` where that release
differs). ``defaults_used`` lists, for ``megatronapp predict``, the rows a
scenario leaves unset and the value each takes there.

Two rows depend on more than the key: ``attention_backend: auto`` lets
Transformer Engine choose the kernel by GPU (cuDNN's fused attention from
compute capability 9.0, FlashAttention-2 before; megatron-core's own unfused
attention where no Transformer Engine runs), and the gradient reduction dtype
follows the precision (fp32 under bf16). A GPU without an architecture
(``cluster.gpu.architecture``, which every named device sets) is the torch
backend's: its megatron-core stages run the local attention and reduce the TP
backward before the weight gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .software import DEFAULT_SOFTWARE, SOFTWARE, Software

# A scenario (scenario/config.py's Scenario, which imports this module to resolve
# its unset keys, so it is not imported back here).
Scenario = Any

MEGATRON_TAG = "core_v0.16.1"  # NVIDIA/Megatron-LM, the release installed here
# Transformer Engine's backend choice (transformer_engine/pytorch/attention/
# dot_product_attention/utils.py, get_attention_backend): "Disabling FlashAttention
# to give FusedAttention preference on Hopper+ for performance reasons".
TE_ATTENTION = {"hopper": "fused", "ampere": "flash"}


def software_of(s: Scenario) -> Software:
    return SOFTWARE[s.cluster.gpu.software or DEFAULT_SOFTWARE]


def attention_backend(s: Scenario) -> str:
    """The attention kernel the scenario runs: its own choice, or what ``auto`` picks."""
    chosen = s.model.attention_backend
    if chosen not in (None, "auto"):
        return chosen
    arch = s.cluster.gpu.architecture
    if not software_of(s).transformer_engine or arch is None:
        return "unfused"
    return TE_ATTENTION[arch]


def async_tp_backward(s: Scenario) -> bool:
    """Megatron-core's column-parallel backward always reduces its input gradient
    asynchronously on a GPU; the Megatron-LM of 2021 waited, and so do the torch
    backend's stages that a scenario without a named GPU describes."""
    chosen = s.parallel.async_tp_backward
    if chosen is not None:
        return chosen
    return software_of(s).megatron_core and s.cluster.gpu.architecture is not None


def _attention_why(s: Scenario) -> str:
    arch = s.cluster.gpu.architecture
    if not software_of(s).transformer_engine:
        return f"{software_of(s).name} runs no Transformer Engine"
    if arch is None:
        return "no GPU architecture named (cluster.gpu.device): megatron-core's local attention"
    return f"Transformer Engine's choice on {arch}"


@dataclass(frozen=True)
class MegatronDefault:
    """One scenario key and the Megatron-core default it mirrors."""

    key: str  # dotted scenario key
    argument: str  # Megatron-LM's command-line argument (or megatron-core's field)
    megatron: Any  # what Megatron takes when the argument is not given
    cited: str  # file:line at MEGATRON_TAG where that is written
    value: Callable[[Scenario], Any]  # what the unset key means in a scenario
    core_field: str = ""  # module:Class.field of installed megatron-core with that default
    why: Callable[[Scenario], str] | None = None  # how value() was decided, where not plain
    differs: str = ""  # where the simulator deliberately does not follow Megatron


def _plain(section: str, name: str) -> Callable[[Scenario], Any]:
    return lambda s: getattr(getattr(s, section), name)


DEFAULTS: tuple[MegatronDefault, ...] = (
    MegatronDefault(
        "model.attention_backend", "--attention-backend", "auto",
        "megatron/core/transformer/transformer_config.py:110 (attention_backend: AttnBackend "
        "= AttnBackend.auto; the flag is built from it, megatron/training/arguments.py:1621)",
        attention_backend, "megatron.core.transformer.transformer_config:TransformerConfig."
        "attention_backend", _attention_why),
    MegatronDefault(
        "training.grad_reduce_in_fp32", "--accumulate-allreduce-grads-in-fp32", "on with bf16",
        "megatron/training/arguments.py:2194 (store_true), turned on for bf16 at "
        "arguments.py:722-723 (--main-grads-dtype fp32, arguments.py:2844)",
        lambda s: s.training.grads_in_fp32, why=lambda s: f"precision {s.training.precision}"),
    MegatronDefault(
        "training.overlap_grad_reduce", "--overlap-grad-reduce", False,
        "megatron/training/arguments.py:2243", _plain("training", "overlap_grad_reduce"),
        "megatron.core.distributed.distributed_data_parallel_config:"
        "DistributedDataParallelConfig.overlap_grad_reduce"),
    MegatronDefault(
        "training.overlap_param_gather", "--overlap-param-gather", False,
        "megatron/training/arguments.py:2264", _plain("training", "overlap_param_gather"),
        "megatron.core.distributed.distributed_data_parallel_config:"
        "DistributedDataParallelConfig.overlap_param_gather"),
    MegatronDefault(
        "training.distributed_optimizer", "--use-distributed-optimizer", False,
        "megatron/training/arguments.py:2283", _plain("training", "distributed_optimizer"),
        "megatron.core.distributed.distributed_data_parallel_config:"
        "DistributedDataParallelConfig.use_distributed_optimizer"),
    MegatronDefault(
        "training.bucket_params", "--ddp-bucket-size", "max(40 M, 1 M·dp·cp)",
        "megatron/training/arguments.py:2251 (None), set at megatron/training/training.py:1317",
        lambda s: s.training.bucket_params or max(40_000_000, 1_000_000 * s.parallel.dp_cp)),
    MegatronDefault(
        "training.gradient_accumulation_fusion", "--no-gradient-accumulation-fusion", True,
        "megatron/training/arguments.py:2083 (store_false)",
        _plain("training", "gradient_accumulation_fusion")),
    MegatronDefault(
        "training.recompute", "--recompute-granularity", None,
        "megatron/core/transformer/transformer_config.py:383", _plain("training", "recompute"),
        "megatron.core.transformer.transformer_config:TransformerConfig.recompute_granularity"),
    MegatronDefault(
        "training.precision", "--bf16 / --fp16", "fp32",
        "megatron/core/model_parallel_config.py:112 (params_dtype float32; fp16 and bf16 "
        "False at :106 and :109)", _plain("training", "precision"),
        "megatron.core.model_parallel_config:ModelParallelConfig.params_dtype",
        differs="bf16: every published run this simulator prices trains in 16 bits"),
    MegatronDefault(
        "parallel.sequence_parallel", "--sequence-parallel", False,
        "megatron/core/model_parallel_config.py:39", _plain("parallel", "sequence_parallel"),
        "megatron.core.model_parallel_config:ModelParallelConfig.sequence_parallel"),
    MegatronDefault(
        "parallel.tp_comm_overlap", "--tp-comm-overlap", False,
        "megatron/core/model_parallel_config.py:186", _plain("parallel", "tp_comm_overlap"),
        "megatron.core.model_parallel_config:ModelParallelConfig.tp_comm_overlap"),
    MegatronDefault(
        "parallel.async_tp_backward", "(no argument: always on)", True,
        "megatron/core/tensor_parallel/layers.py:544 (the input gradient's all-reduce, "
        "async_op=True, before the weight gradient); at core_r0.8.0 already, "
        "--no-async-tensor-model-parallel-allreduce is ignored (arguments.py:1152)",
        async_tp_backward, why=lambda s: software_of(s).name + (
            "" if s.cluster.gpu.architecture else
            ", no GPU architecture named: the torch backend's stages wait")),
    MegatronDefault(
        "parallel.account_for_embedding_in_pipeline_split",
        "--account-for-embedding-in-pipeline-split", False,
        "megatron/core/transformer/transformer_config.py:96",
        _plain("parallel", "account_for_embedding_in_pipeline_split"),
        "megatron.core.transformer.transformer_config:TransformerConfig."
        "account_for_embedding_in_pipeline_split"),
    MegatronDefault(
        "parallel.account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split",
        False, "megatron/core/transformer/transformer_config.py:100",
        _plain("parallel", "account_for_loss_in_pipeline_split"),
        "megatron.core.transformer.transformer_config:TransformerConfig."
        "account_for_loss_in_pipeline_split"),
    MegatronDefault(
        "parallel.decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers",
        None, "megatron/training/arguments.py:2209 (None: an even split)",
        _plain("parallel", "decoder_first_pipeline_num_layers")),
    MegatronDefault(
        "parallel.decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers",
        None, "megatron/training/arguments.py:2213 (None: an even split)",
        _plain("parallel", "decoder_last_pipeline_num_layers")),
    MegatronDefault(
        "parallel.microbatch_group_size", "--microbatch-group-size-per-virtual-pipeline-stage",
        "pp", "megatron/core/model_parallel_config.py:447-448",
        lambda s: s.parallel.group_size),
    MegatronDefault(
        "parallel.cp_comm_type", "--cp-comm-type", "p2p",
        "megatron/training/arguments.py:2341", lambda s: s.parallel.cp_comm_type or "p2p"),
    MegatronDefault(
        "model.make_vocab_size_divisible_by", "--make-vocab-size-divisible-by", 128,
        "megatron/training/arguments.py:1678", _plain("model", "make_vocab_size_divisible_by")),
    MegatronDefault(
        "model.position_embedding_type", "--position-embedding-type", "learned_absolute",
        "megatron/training/arguments.py:1645",
        lambda s: s.model.position_embedding_type or "learned_absolute"),
    MegatronDefault(
        "model.untie_embeddings", "--untie-embeddings-and-output-weights", False,
        "megatron/training/arguments.py:1697", _plain("model", "untie_embeddings")),
    MegatronDefault(
        "model.hidden_dropout", "--hidden-dropout", 0.1,
        "megatron/core/transformer/transformer_config.py:137", _plain("model", "hidden_dropout"),
        "megatron.core.transformer.transformer_config:TransformerConfig.hidden_dropout"),
    MegatronDefault(
        "model.attention_dropout", "--attention-dropout", 0.1,
        "megatron/core/transformer/transformer_config.py:140",
        _plain("model", "attention_dropout"),
        "megatron.core.transformer.transformer_config:TransformerConfig.attention_dropout"),
    MegatronDefault(
        "model.ffn_hidden_size", "--ffn-hidden-size", "4·hidden (swiglu: ⌊8·hidden/3/64⌋·64)",
        "megatron/training/arguments.py:803-811", lambda s: s.model.ffn),
)


def unset_keys(data: dict[str, Any]) -> set[str]:
    """The table's keys that the raw scenario mapping ``data`` does not write
    (``ffn_hidden`` is accepted for ``ffn_hidden_size``)."""
    def written(key: str) -> bool:
        section, name = key.split(".")
        part = data.get(section)
        names = {name, "ffn_hidden"} if name == "ffn_hidden_size" else {name}
        return isinstance(part, dict) and bool(names & part.keys())

    return {d.key for d in DEFAULTS if not written(d.key)}


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "none" if value is None else f"{value:,}" if isinstance(value, int) else str(value)


def defaults_used(s: Scenario, unset: set[str]) -> list[str]:
    """One line per unset key: the value it takes here, and the Megatron default it mirrors."""
    lines = []
    for d in DEFAULTS:
        if d.key not in unset:
            continue
        how = f" ({d.why(s)})" if d.why else ""
        mirrors = (f"Megatron's {d.argument}: {_shown(d.megatron)}" if not d.differs
                   else f"not Megatron's {_shown(d.megatron)}: {d.differs}")
        lines.append(f"{d.key}: {_shown(d.value(s))}{how}; {mirrors}")
    return lines
