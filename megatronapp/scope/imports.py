"""Checkpoints from the ecosystem, as the megatron-core GPTModel MegaScope runs.

Two sources, each a state dict (numpy arrays by name) and a configuration:

- a Hugging Face GPT-2 (``config.json`` with ``model_type: gpt2``): its Conv1D
  weights are transposed, the fused QKV reordered from thirds (Q | K | V) to
  megatron's groups (per head: its q, k, v rows), the tied unembedding copied;
- a Megatron-LM / megatron-core checkpoint (its ``args``): Transformer Engine's
  fused layer-norm names become the local spec's, a missing linear bias
  (``--disable-bias-linear``) is zeros, a tied output layer is the embedding.

Only what the checkpoint format here holds is accepted (LayerNorm with
epsilon 1e-5, gelu, learned absolute positions, as many query groups as
heads); anything else is refused with one line naming the setting. The
vocabulary is padded with zero rows to a multiple of 128 (megatron's
``make_vocab_size_divisible_by``) so that any tensor-parallel split divides
it; ``vocab_size`` in ``checkpoint.json`` keeps the real one. No torch here.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from ..errors import UserError
from ..io import gate
from ..scenario.config import Model

PAD_MULTIPLE = 128
EPSILON = 1e-5  # megatron-core's layernorm_epsilon, which the torch backend builds with
# Transformer Engine's fused names -> the local spec's (megatron-core's own mapping)
TE_TO_LOCAL = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
               "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
               "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
               "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
LAYER_BIASES = ("self_attention.linear_qkv.bias", "self_attention.linear_proj.bias",
                "mlp.linear_fc1.bias", "mlp.linear_fc2.bias")


@dataclass(frozen=True)
class Imported:
    """A foreign checkpoint as ours: the model, its weights, the real vocabulary."""

    model: Model
    state: dict[str, np.ndarray]
    vocab_size: int
    source: dict[str, Any]


def _refuse(source: str, what: str) -> UserError:
    return UserError(f"SRC: {source}: {what}")


def padded(vocab: int) -> int:
    return -(-vocab // PAD_MULTIPLE) * PAD_MULTIPLE


def _pad_rows(w: np.ndarray, rows: int) -> np.ndarray:
    if w.shape[0] == rows:
        return w
    return np.concatenate([w, np.zeros((rows - w.shape[0], *w.shape[1:]), w.dtype)])


def _f32(w: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(w, dtype=np.float32))


# ------------------------------------------------------------ Hugging Face GPT-2
def gpt2_model(config: Mapping[str, Any], source: str) -> tuple[Model, bool]:
    """The model a GPT-2 ``config.json`` describes, and whether its output
    layer is tied to the embedding."""
    if config.get("model_type") != "gpt2":
        raise _refuse(source, f"config.json: model_type {config.get('model_type')!r} "
                      "(GPT-2-architecture models only: model_type gpt2)")
    act = config.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise _refuse(source, f"config.json: activation_function {act!r} (gelu_new or gelu)")
    checks = {"layer_norm_epsilon": EPSILON, "scale_attn_weights": True,
              "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False}
    for key, want in checks.items():
        got = config.get(key, want)
        if got != want:
            raise _refuse(source, f"config.json: {key} {got!r} (only {want!r} is supported)")
    hidden = int(config["n_embd"])
    model = Model(layers=int(config["n_layer"]), hidden=hidden, heads=int(config["n_head"]),
                  seq_len=int(config["n_positions"]), vocab=padded(int(config["vocab_size"])),
                  ffn_hidden=int(config.get("n_inner") or 4 * hidden),
                  openai_gelu=act != "gelu")
    return model, bool(config.get("tie_word_embeddings", True))


def _qkv_groups(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows Q | K | V (each heads × head_dim) -> per head q, k, v."""
    rest = w.shape[1:]
    thirds = w.reshape(3, heads, -1, *rest)
    return thirds.swapaxes(0, 1).reshape(w.shape[0], *rest)


def gpt2_state(hf: Mapping[str, np.ndarray], model: Model, tied: bool,
               source: str) -> dict[str, np.ndarray]:
    """A GPT-2 state dict (``GPT2LMHeadModel`` or ``GPT2Model`` names) as megatron's."""
    get = _getter({k.removeprefix("transformer."): v for k, v in hf.items()}, source)
    vocab = model.vocab
    out = {"embedding.word_embeddings.weight": _pad_rows(_f32(get("wte.weight")), vocab),
           "embedding.position_embeddings.weight": _f32(get("wpe.weight")),
           "decoder.final_layernorm.weight": _f32(get("ln_f.weight")),
           "decoder.final_layernorm.bias": _f32(get("ln_f.bias"))}
    head = hf.get("lm_head.weight")
    if head is None and not tied:
        raise _refuse(source, "no lm_head.weight, and config.json unties it")
    out["output_layer.weight"] = _pad_rows(_f32(get("wte.weight") if head is None else head),
                                           vocab)
    for i in range(model.layers):
        h = f"h.{i}."
        mine = f"decoder.layers.{i}."
        out.update({
            mine + "input_layernorm.weight": _f32(get(h + "ln_1.weight")),
            mine + "input_layernorm.bias": _f32(get(h + "ln_1.bias")),
            mine + "self_attention.linear_qkv.weight":
                _f32(_qkv_groups(np.asarray(get(h + "attn.c_attn.weight")).T, model.heads)),
            mine + "self_attention.linear_qkv.bias":
                _f32(_qkv_groups(np.asarray(get(h + "attn.c_attn.bias")), model.heads)),
            mine + "self_attention.linear_proj.weight": _f32(np.asarray(
                get(h + "attn.c_proj.weight")).T),
            mine + "self_attention.linear_proj.bias": _f32(get(h + "attn.c_proj.bias")),
            mine + "pre_mlp_layernorm.weight": _f32(get(h + "ln_2.weight")),
            mine + "pre_mlp_layernorm.bias": _f32(get(h + "ln_2.bias")),
            mine + "mlp.linear_fc1.weight": _f32(np.asarray(get(h + "mlp.c_fc.weight")).T),
            mine + "mlp.linear_fc1.bias": _f32(get(h + "mlp.c_fc.bias")),
            mine + "mlp.linear_fc2.weight": _f32(np.asarray(get(h + "mlp.c_proj.weight")).T),
            mine + "mlp.linear_fc2.bias": _f32(get(h + "mlp.c_proj.bias"))})
    return out


def _getter(state: Mapping[str, np.ndarray], source: str) -> Any:
    def get(name: str) -> np.ndarray:
        if name not in state:
            raise _refuse(source, f"the weights have no {name}")
        return state[name]
    return get


def import_gpt2(config: Mapping[str, Any], weights: Callable[[], Mapping[str, np.ndarray]],
                source: str) -> Imported:
    """The configuration is judged before ``weights()`` reads anything."""
    model, tied = gpt2_model(config, source)
    return Imported(model, gpt2_state(weights(), model, tied, source), int(config["vocab_size"]),
                    {"format": "huggingface-gpt2", "path": source})


# -------------------------------------------------------------- Megatron-LM
def megatron_model(args: Mapping[str, Any], source: str) -> Model:
    """The model a Megatron-LM checkpoint's ``args`` describe."""
    def arg(name: str, default: Any = None) -> Any:
        return args.get(name, default)

    heads, hidden = int(arg("num_attention_heads")), int(arg("hidden_size"))
    refused = {"swiglu": (arg("swiglu", False), False),
               "normalization": (arg("normalization", "LayerNorm"), "LayerNorm"),
               "position_embedding_type": (arg("position_embedding_type", "learned_absolute"),
                                           "learned_absolute"),
               "apply_layernorm_1p": (arg("apply_layernorm_1p", False), False),
               "qk_layernorm": (arg("qk_layernorm", False), False),
               "squared_relu": (arg("squared_relu", False), False),
               "num_query_groups": (arg("num_query_groups") if arg("group_query_attention")
                                    else heads, heads),
               "kv_channels": (arg("kv_channels") or hidden // heads, hidden // heads),
               "layernorm_epsilon": (arg("norm_epsilon", arg("layernorm_epsilon", EPSILON)),
                                     EPSILON),
               "num_experts": (arg("num_experts"), None)}
    for name, (got, want) in refused.items():
        if got != want:
            raise _refuse(source, f"args.{name} = {got!r} (only {want!r} is supported)")
    vocab = arg("padded_vocab_size")
    if vocab is None:
        raise _refuse(source, "args has no padded_vocab_size")
    return Model(layers=int(arg("num_layers")), hidden=hidden, heads=heads,
                 seq_len=int(arg("max_position_embeddings") or arg("seq_length")),
                 vocab=padded(int(vocab)), ffn_hidden=int(arg("ffn_hidden_size") or 4 * hidden),
                 openai_gelu=bool(arg("openai_gelu", False)))


def megatron_state(state: Mapping[str, np.ndarray], model: Model,
                   source: str) -> dict[str, np.ndarray]:
    """A megatron-core GPTModel's weights (local or Transformer Engine names)
    as the local spec's, unsplit."""
    if any(k.startswith("language_model.") for k in state):
        raise _refuse(source, "a legacy Megatron-LM model (language_model.*): convert it to "
                      "megatron-core first (Megatron-LM's checkpoint converter)")
    out: dict[str, np.ndarray] = {}
    for name, value in state.items():
        if name.endswith("_extra_state"):
            continue
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            rest = ".".join(parts[3:])
            name = ".".join(parts[:3] + [TE_TO_LOCAL.get(rest, rest)])
        out[name] = _f32(value)
    for i in range(model.layers):
        for bias in LAYER_BIASES:
            rows = out.get(f"decoder.layers.{i}.{bias.removesuffix('.bias')}.weight")
            if rows is not None:
                out.setdefault(f"decoder.layers.{i}.{bias}", np.zeros(rows.shape[0], np.float32))
    embed = out.get("embedding.word_embeddings.weight")
    if embed is None:
        raise _refuse(source, "the weights have no embedding.word_embeddings.weight")
    out.setdefault("output_layer.weight", embed.copy())  # tied: the embedding
    out["embedding.word_embeddings.weight"] = _pad_rows(embed, model.vocab)
    out["output_layer.weight"] = _pad_rows(out["output_layer.weight"], model.vocab)
    return out


def import_megatron(args: Mapping[str, Any], state: Mapping[str, np.ndarray], source: str,
                    kind: str) -> Imported:
    model = megatron_model(args, source)
    return Imported(model, megatron_state(state, model, source), int(args["padded_vocab_size"]),
                    {"format": f"megatron-{kind}", "path": source})


def write_imported(imported: Imported, run: Path, source: Path) -> None:
    """``run/checkpoint`` (the weights, with the tokenizer of a Hugging Face
    folder beside them) and an empty capture ``run/scope`` that the analyses'
    results join; ``run`` is a staging folder (``io.outdirs.staged_dir``)."""
    from ..scenario.checkpoint import write_checkpoint
    from ..scenario.config import Data
    from .storage import merge_capture
    from .tokens import TOKENIZER_FILE, tokenizer_meta

    info: dict[str, Any] = {"source": imported.source, "vocab_size": imported.vocab_size}
    tokenizer = (tokenizer_meta(source, _config(source))
                 if imported.source["format"] == "huggingface-gpt2" else None)
    if tokenizer is not None:
        info["tokenizer"] = tokenizer
    folder = write_checkpoint(run / "checkpoint", imported.state, imported.model,
                              Data(kind="random"), info)
    if tokenizer is not None:
        shutil.copyfile(source / TOKENIZER_FILE, folder / TOKENIZER_FILE)
    (run / "scope").mkdir()
    merge_capture(run / "scope", {"source": "import", "scenario": "import", "seed": 0,
                                  "model": imported.model.model_dump(mode="json"),
                                  "observe": [], "perturb": []})


def _config(source: Path) -> dict[str, Any]:
    config: dict[str, Any] = gate.read_json(source / "config.json", "SRC")
    return config
