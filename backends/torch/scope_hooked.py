"""MegaScope's model object: a checkpoint's megatron-core model, loaded once,
used as TransformerLens's ``HookedTransformer`` is.

``load(run_dir, pp=1, tp=1)`` builds the model in this process (one stage,
one TP rank) or on ``pp * tp`` worker processes (``scope_pool``). Either way
the object runs batches of prompts (strings, right-padded, or a ``[batch,
pos]`` LongTensor of token ids), calls hook functions ``fn(tensor, hook)`` at
the hook points ``megatronapp.scope.names`` names, in this process, with whole
tensors in TransformerLens's layout (a hook that returns a tensor, or edits
its argument in place, changes what flows on), and caches any of them.
Megatron-core's and Transformer Engine's warnings while the model is built
are kept in ``warnings`` instead of being printed.
"""
from __future__ import annotations

import contextlib
import weakref
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence, Union

import numpy as np
import torch

from megatronapp.errors import UserError
from megatronapp.io.progress import Say, quiet
from megatronapp.scenario.checkpoint import Checkpoint, read_checkpoint
from megatronapp.scenario.config import parse_scenario
from megatronapp.scope.storage import checkpoint_dir
from megatronapp.scope.quiet import kept_warnings
from megatronapp.scope.names import Key, NamesFilter, hook_name, matching, site_of
from megatronapp.scope.tokens import Tokenizer, encode_checked, tokenizer_of

from .scope_points import Visit, attached

Tensor = torch.Tensor
Input = Union[str, Sequence[str], Tensor]
HookFn = Callable[..., Any]


@dataclass(frozen=True)
class HookPoint:
    """What a hook function receives as ``hook``: the point's name."""

    name: str

    def layer(self) -> int:
        layer = site_of(self.name)[1]
        if layer is None:
            raise ValueError(f"{self.name} is not in a block")
        return layer


@dataclass(frozen=True)
class Config:
    """TransformerLens's names for the model's sizes, and how it is split."""

    n_layers: int
    d_model: int
    n_heads: int
    d_head: int
    d_mlp: int
    d_vocab: int
    n_ctx: int
    act_fn: str
    pp: int = 1
    tp: int = 1

    @classmethod
    def of(cls, ckpt: Checkpoint, pp: int, tp: int) -> "Config":
        m = ckpt.model
        return cls(m.layers, m.hidden, m.heads, m.hidden // m.heads, m.ffn,
                   int(ckpt.meta.get("vocab_size", m.vocab)), m.seq_len,
                   "gelu_new" if m.openai_gelu else "gelu", pp, tp)


class Runner(Protocol):
    """Runs forward passes of the model, wherever it lives."""

    warnings: list[str]

    def forward(self, tokens: Tensor, names: Sequence[str], visit: Visit) -> Tensor: ...

    def close(self) -> None: ...


@dataclass
class LocalRunner:
    """The whole model in this process (one gloo rank, held until ``close``)."""

    model: Any
    head_dim: int
    stop: Any  # weakref.finalize closing the one-rank group (at exit at the latest)
    warnings: list[str] = field(default_factory=list)
    threads: int = 1  # as each worker rank: more threads contend on a busy machine

    @classmethod
    def start(cls, ckpt: Checkpoint, threads: int = 1) -> "LocalRunner":
        kept: list[str] = []
        stack = ExitStack()
        with kept_warnings(kept):
            from .scope_generate import build_model, one_rank

            stack.enter_context(one_rank())
            s = parse_scenario({"seed": 0, "model": ckpt.model.model_dump(mode="json"),
                                "data": {"kind": "random"}})
            model = build_model(s, ckpt.state)
        runner = cls(model, ckpt.model.hidden // ckpt.model.heads, None, kept, threads)
        runner.stop = weakref.finalize(runner, stack.close)
        return runner

    def forward(self, tokens: Tensor, names: Sequence[str], visit: Visit) -> Tensor:
        from .megatron_compat import causal_mask

        b, s = tokens.shape
        outer = torch.get_num_threads()
        torch.set_num_threads(self.threads)  # for this pass only
        try:
            with attached(self.model, names, visit, self.head_dim), torch.no_grad():
                return self.model(tokens, torch.arange(s).expand(b, s), causal_mask(s))
        finally:
            torch.set_num_threads(outer)

    def close(self) -> None:
        self.stop()


class ActivationCache:
    """Hook point -> tensor of one run; keys as ``names`` resolves them
    (``cache["blocks.0.hook_resid_pre"]``, ``cache["resid_pre", 0]``,
    ``cache["attn.probs", 1]``)."""

    def __init__(self, acts: dict[str, Tensor], layers: int):
        self.cache_dict, self.layers = acts, layers

    def __getitem__(self, key: Key) -> Tensor:
        name = hook_name(key, self.layers, "cache")
        if name not in self.cache_dict:
            raise KeyError(f"{name} was not cached (names_filter)")
        return self.cache_dict[name]

    def __contains__(self, key: object) -> bool:
        try:
            return hook_name(key, self.layers, "cache") in self.cache_dict  # type: ignore[arg-type]
        except UserError:
            return False

    def __len__(self) -> int:
        return len(self.cache_dict)

    def __iter__(self) -> Iterator[str]:
        return iter(self.cache_dict)

    def keys(self) -> list[str]:
        return list(self.cache_dict)

    def items(self) -> list[tuple[str, Tensor]]:
        return list(self.cache_dict.items())

    def remove_batch_dim(self) -> "ActivationCache":
        """The cache of a one-prompt batch without its batch axis."""
        if any(t.shape[0] != 1 for t in self.cache_dict.values()):
            raise ValueError("remove_batch_dim: the batch has more than one prompt")
        return ActivationCache({k: t[0] for k, t in self.cache_dict.items()}, self.layers)


class HookedModel:
    """A checkpoint's model; see the module docstring. ``close()`` (or a
    ``with`` block) ends its processes."""

    def __init__(self, ckpt: Checkpoint, runner: Runner, pp: int = 1, tp: int = 1):
        self.ckpt, self.runner = ckpt, runner
        self.cfg = Config.of(ckpt, pp, tp)
        self.tokenizer: Tokenizer | None = tokenizer_of(ckpt)
        self.warnings = runner.warnings
        self._hooks: list[tuple[str, HookFn]] = []
        self._readout: dict[str, Tensor] = {}

    # ------------------------------------------------------------ tokens
    def to_tokens(self, text: str | Sequence[str], prepend_bos: bool | None = None) -> Tensor:
        """``[batch, pos]`` token ids; several prompts are right-padded."""
        texts = [text] if isinstance(text, str) else list(text)
        if not texts:
            raise UserError("input: no prompt")
        rows = [encode_checked(self.tokenizer, t, self.cfg.n_ctx, "input", prepend_bos)
                for t in texts]
        pad = self.tokenizer.pad if self.tokenizer is not None else 0
        width = max(len(r) for r in rows)
        return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)

    def to_str_tokens(self, input: Input) -> list[str] | list[list[str]]:
        tokens = self.input_tokens(input)
        rows = [[self.to_single_str_token(int(i)) for i in row] for row in tokens]
        return rows[0] if len(rows) == 1 else rows

    def to_string(self, tokens: Tensor | Sequence[int]) -> str | list[str]:
        t = torch.as_tensor(tokens)
        if self.tokenizer is None:
            raise UserError("tokens: this checkpoint has no tokenizer to decode them")
        if t.dim() == 1:
            return self.tokenizer.decode(t.tolist())
        return [self.tokenizer.decode(row.tolist()) for row in t]

    def to_single_str_token(self, token_id: int) -> str:
        """One token id as text (its id, for a checkpoint without a tokenizer)."""
        return self.tokenizer.token(token_id) if self.tokenizer is not None else str(token_id)

    def input_tokens(self, input: Input) -> Tensor:
        """``input`` as a checked ``[batch, pos]`` LongTensor (text is tokenized)."""
        if not isinstance(input, torch.Tensor):
            return self.to_tokens(input)
        t = input[None] if input.dim() == 1 else input
        if t.dim() != 2 or t.dtype not in (torch.int64, torch.int32):
            raise UserError(f"tokens: a [batch, pos] integer tensor, got {tuple(t.shape)} "
                            f"{t.dtype}")
        if t.shape[1] > self.cfg.n_ctx or t.shape[1] == 0:
            raise UserError(f"tokens: 1..{self.cfg.n_ctx} positions, got {t.shape[1]}")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.cfg.d_vocab):
            raise UserError(f"tokens: ids must be in 0..{self.cfg.d_vocab - 1}")
        return t.long().cpu()

    # ------------------------------------------------------------- hooks
    def add_hook(self, name: Key, fn: HookFn) -> None:
        """A hook that stays until ``reset_hooks()``."""
        self._hooks.append((hook_name(name, self.cfg.n_layers, "add_hook"), fn))

    def reset_hooks(self) -> None:
        self._hooks = []

    @contextlib.contextmanager
    def hooks(self, fwd_hooks: Sequence[tuple[Key, HookFn]] = ()) -> Iterator["HookedModel"]:
        """``fwd_hooks`` added for the block, removed after it."""
        kept = list(self._hooks)
        try:
            for name, fn in fwd_hooks:
                self.add_hook(name, fn)
            yield self
        finally:
            self._hooks = kept

    # ----------------------------------------------------------- forward
    def __call__(self, input: Input) -> Tensor:
        """Logits ``[batch, pos, d_vocab]``."""
        return self._run(self.input_tokens(input), self._hooks)

    forward = __call__

    def run_with_hooks(self, input: Input, fwd_hooks: Sequence[tuple[Key, HookFn]] = ()
                       ) -> Tensor:
        with self.hooks(fwd_hooks):
            return self(input)

    def run_with_cache(self, input: Input, names_filter: NamesFilter = None,
                       remove_batch_dim: bool = False) -> tuple[Tensor, ActivationCache]:
        """Logits and every hook point ``names_filter`` keeps (default all)."""
        acts: dict[str, Tensor] = {}

        def keep(t: Tensor, hook: HookPoint) -> None:
            acts[hook.name] = t.detach().clone()

        chosen = matching(names_filter, self.cfg.n_layers)
        logits = self.run_with_hooks(input, [(n, keep) for n in chosen])
        cache = ActivationCache({n: acts[n] for n in chosen if n in acts}, self.cfg.n_layers)
        return logits, cache.remove_batch_dim() if remove_batch_dim else cache

    def _run(self, tokens: Tensor, hooks: Sequence[tuple[str, HookFn]]) -> Tensor:
        by_name: dict[str, list[HookFn]] = {}
        for name, fn in hooks:
            by_name.setdefault(name, []).append(fn)

        def visit(name: str, t: Tensor) -> Tensor:
            for fn in by_name[name]:
                out = fn(t, hook=HookPoint(name))
                if out is not None:
                    if tuple(out.shape) != tuple(t.shape):
                        raise ValueError(f"hook at {name} returned shape {tuple(out.shape)}, "
                                         f"expected {tuple(t.shape)}")
                    t = out
            return t

        logits = self.runner.forward(tokens, list(by_name), visit)
        return logits[..., :self.cfg.d_vocab].float()

    # ----------------------------------------------------------- weights
    def weight(self, name: str) -> Tensor:
        """A parameter of the whole model by megatron's name, e.g.
        ``decoder.final_layernorm.weight`` (from the checkpoint: any split)."""
        if name not in self._readout:
            self._readout[name] = torch.from_numpy(np.asarray(self.ckpt.state[name],
                                                              np.float32))
        return self._readout[name]

    @property
    def W_U(self) -> Tensor:
        """The unembedding ``[d_model, d_vocab]``."""
        return self.weight("output_layer.weight")[:self.cfg.d_vocab].T

    @property
    def W_O(self) -> Tensor:
        """Each block's attention output weights ``[n_layers, n_heads, d_head, d_model]``."""
        c = self.cfg
        return torch.stack([
            self.weight(f"decoder.layers.{n}.self_attention.linear_proj.weight").T.reshape(
                c.n_heads, c.d_head, c.d_model) for n in range(c.n_layers)])

    @property
    def b_O(self) -> Tensor:
        c = self.cfg
        return torch.stack([self.weight(f"decoder.layers.{n}.self_attention.linear_proj.bias")
                            for n in range(c.n_layers)])

    def ln_final(self, resid: Tensor) -> Tensor:
        """The final LayerNorm (each position normalised by its own scale)."""
        return torch.nn.functional.layer_norm(
            resid.float(), (self.cfg.d_model,), self.weight("decoder.final_layernorm.weight"),
            self.weight("decoder.final_layernorm.bias"), eps=1e-5)

    def unembed(self, x: Tensor) -> Tensor:
        return x.float() @ self.W_U

    # ---------------------------------------------------------- lifetime
    def close(self) -> None:
        self.runner.close()

    def __enter__(self) -> "HookedModel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.cfg
        return (f"HookedModel({self.ckpt.path}: {c.n_layers} blocks, d_model {c.d_model}, "
                f"{c.n_heads} heads, d_vocab {c.d_vocab}, pp {c.pp}, tp {c.tp})")


def load(target: str | Path, pp: int = 1, tp: int = 1, say: Say = quiet,
         threads: int = 1) -> HookedModel:
    """The checkpoint under ``target`` (a run directory, a checkpoint, a
    ``scope generate`` output), built once: here, or split ``pp`` × ``tp``.
    ``threads``: torch threads of this process's forward passes (each worker
    rank uses one)."""
    if pp < 1 or tp < 1:
        raise UserError(f"--pp/--tp: must be >= 1, got pp {pp}, tp {tp}")
    if threads < 1:
        raise UserError(f"threads: must be >= 1, got {threads}")
    ckpt = read_checkpoint(checkpoint_dir(target))
    if pp == tp == 1:
        say(f"building {ckpt.path} in this process")
        return HookedModel(ckpt, LocalRunner.start(ckpt, threads))
    from .scope_pool import PoolRunner

    return HookedModel(ckpt, PoolRunner.start(ckpt, pp, tp, say), pp, tp)
