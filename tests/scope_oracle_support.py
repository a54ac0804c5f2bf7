"""A small random GPT-2 built here (no download), its Hugging Face folder, and
TransformerLens's HookedTransformer on the same weights: the oracle MegaScope's
model object and analyses are held to."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

VOCAB = 250  # not a multiple of 128: the import pads it, the logits must not show it
LAYERS, HIDDEN, HEADS, CONTEXT = 2, 32, 4, 16


@dataclass(frozen=True)
class Gpt2:
    folder: Path  # save_pretrained's output
    hf: Any  # transformers.GPT2LMHeadModel
    lens: Any  # transformer_lens.HookedTransformer, weights as they are
    folded: Any  # the same with TransformerLens's default processing (layer norm folded)


def gpt2(folder: Path, seed: int = 0, safetensors: bool = True) -> Gpt2:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=HIDDEN, n_layer=LAYERS,
                        n_head=HEADS, bos_token_id=0, eos_token_id=0)
    hf = GPT2LMHeadModel(config).eval()
    if safetensors:
        hf.save_pretrained(folder)
    else:  # what older transformers' save_pretrained wrote (5.x writes safetensors only)
        hf.config.save_pretrained(folder)
        torch.save(hf.state_dict(), folder / "pytorch_model.bin")
    return Gpt2(folder, hf, _lens(hf, fold=False), _lens(hf, fold=True))


def _lens(hf: Any, fold: bool) -> Any:
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    c = hf.config
    cfg = HookedTransformerConfig(n_layers=c.n_layer, d_model=c.n_embd, n_ctx=c.n_positions,
                                  d_head=c.n_embd // c.n_head, n_heads=c.n_head,
                                  d_mlp=4 * c.n_embd, d_vocab=c.vocab_size, act_fn="gelu_new",
                                  normalization_type="LN", eps=c.layer_norm_epsilon)
    model = HookedTransformer(cfg)
    # folded: TransformerLens's defaults, but the value biases stay in each head's output
    # (as MegaScope's per-head attribution counts them)
    model.load_and_process_state_dict(convert_gpt2_weights(hf, cfg), fold_ln=fold,
                                      center_writing_weights=fold, center_unembed=fold,
                                      fold_value_biases=False)
    return model.eval()


def prompts(seed: int, batch: int = 2, length: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """A clean batch of token ids and a corrupted one, one position apart."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(1, VOCAB, (batch, length), generator=g)
    corrupt = clean.clone()
    corrupt[:, length // 2] = (corrupt[:, length // 2] + 7) % (VOCAB - 1) + 1
    return clean, corrupt


CHARACTERS = "abcdefghijklmnopqrstuvwxyz .,"


def save_char_tokenizer(folder: Path) -> None:
    """A character-level ``tokenizer.json`` (id 0: ``<|endoftext|>``, GPT-2's BOS)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(CHARACTERS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(folder / "tokenizer.json"))
