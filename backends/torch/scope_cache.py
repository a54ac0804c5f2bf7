"""One forward pass of a checkpoint's model with every site read (or one patched),
for notebooks, ``scope lens`` and ``scope patch``: one process, CPU, tp = pp = 1.

Sites and layers are the capture's: ``("resid_pre", 1)`` is the residual stream
entering layer 1 (layers count from 1), ``("attn.q", 2)`` the queries of layer
2. Arrays drop the batch dimension: ``(tokens, channels)``, ``(tokens, heads,
head_dim)`` for q/k/v, ``(heads, query, key)`` for ``attn.probs``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from megatronapp.io import gate
from megatronapp.scenario.checkpoint import Checkpoint, read_checkpoint
from megatronapp.scenario.config import parse_scenario
from megatronapp.errors import UserError
from megatronapp.scope.lens import LAYER_SITES
from megatronapp.scope.storage import find_capture

from .scope import ACCESS, attention_materialised
from .scope_generate import build_model, one_rank

POSITION_AXIS = {"sbh": 0, "sbnh": 0, "bnsk": 2}  # where the token position is, by layout


def checkpoint_dir(target: str | Path) -> Path:
    """A checkpoint directory, a run directory holding one, or a generation
    capture (or its ``scope generate`` output) naming the checkpoint it ran on."""
    p = Path(target)
    if (p / "checkpoint" / "checkpoint.json").is_file():
        return p / "checkpoint"
    for capture in (p, p / "clean"):
        try:
            named = gate.read_json(capture / "manifest.json", "").get("checkpoint")
        except (OSError, ValueError, AttributeError):  # a TextError (a FIFO, bad JSON) too
            continue
        if isinstance(named, str):
            return Path(named)
    return p


@dataclass(frozen=True)
class Patch:
    """Replace ``site`` at ``layer`` and token ``position`` by ``value`` (that
    position's slice of the same site in another run)."""

    site: str
    layer: int
    position: int
    value: torch.Tensor


@dataclass(frozen=True)
class ActivationCache:
    """Every hooked site of one forward pass, and its logits."""

    prompt: str
    tokens: list[str]  # one character per position
    logits: np.ndarray  # (tokens, vocab)
    acts: dict[tuple[str, int], np.ndarray]

    def __getitem__(self, key: tuple[str, int]) -> np.ndarray:
        return self.acts[key]

    def keys(self) -> list[tuple[str, int]]:
        return sorted(self.acts, key=lambda k: (k[1], LAYER_SITES.index(k[0])))


def _batchless(t: torch.Tensor, layout: str) -> np.ndarray:
    x = t.detach().double()
    return (x[0] if layout == "bnsk" else x[:, 0]).numpy()


@dataclass
class LoadedModel:
    """A checkpoint's model, built once; call inside ``one_rank()``."""

    ckpt: Checkpoint
    model: Any

    @classmethod
    def load(cls, target: str | Path) -> "LoadedModel":
        ckpt = read_checkpoint(checkpoint_dir(target))
        if ckpt.vocab is None:
            raise UserError(f"CHECKPOINT: {ckpt.path}: no character vocabulary (trained on "
                            "random tokens)")
        s = parse_scenario({"seed": 0, "model": ckpt.model.model_dump(mode="json"),
                            "data": {"kind": "random"}})
        return cls(ckpt, build_model(s, ckpt.state))

    @property
    def layers(self) -> int:
        return int(self.ckpt.model.layers)

    def encode(self, prompt: str, option: str = "--prompt") -> list[int]:
        assert self.ckpt.vocab is not None  # checked in load
        ids = [int(i) for i in self.ckpt.vocab.encode(prompt)]
        if not ids or len(ids) > self.ckpt.model.seq_len:
            raise UserError(f"{option}: must have 1..{self.ckpt.model.seq_len} characters, "
                            f"got {len(ids)}")
        return ids

    def decode(self, ids: Sequence[int]) -> list[str]:
        assert self.ckpt.vocab is not None
        return [self.ckpt.vocab.decode([int(i)]) for i in ids]

    def sites(self, wanted: Sequence[str] | None, option: str = "sites") -> tuple[str, ...]:
        sites = tuple(wanted) if wanted is not None else LAYER_SITES
        unknown = [s for s in sites if s not in LAYER_SITES]
        if unknown:
            raise UserError(f"{option}: unknown {unknown} (choose from {', '.join(LAYER_SITES)})")
        if not attention_materialised(self.model.decoder.layers[0]):
            sites = tuple(s for s in sites if s != "attn.probs")
        return sites

    def forward(self, ids: list[int], sites: Sequence[str] = (), patch: Patch | None = None
                ) -> tuple[np.ndarray, dict[tuple[str, int], torch.Tensor]]:
        """Logits (tokens, vocab) and the raw tensors of ``sites`` at every layer."""
        from .megatron_compat import causal_mask

        seen: dict[tuple[str, int], torch.Tensor] = {}
        with self._hooks(sites, seen, patch), torch.no_grad():
            out = self.model(torch.tensor([ids]), torch.arange(len(ids))[None],
                             causal_mask(len(ids)))
        return out[0].double().numpy(), seen

    @contextlib.contextmanager
    def _hooks(self, sites: Sequence[str], seen: dict[tuple[str, int], torch.Tensor],
               patch: Patch | None) -> Iterator[None]:
        wanted = {(s, int(layer.layer_number)) for s in sites for layer in self.model.decoder.layers}
        if patch is not None:
            wanted.add((patch.site, patch.layer))
        handles = []
        for layer in self.model.decoder.layers:
            for site in {s for s, n in wanted if n == int(layer.layer_number)}:
                access = ACCESS[site]
                here = patch if patch is not None and (patch.site, patch.layer) == (
                    site, int(layer.layer_number)) else None
                hook = _site_hook(access, (site, int(layer.layer_number)), seen, here)
                module = access.module(layer)
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True)
                               if access.pre else module.register_forward_hook(
                                   lambda m, a, out, hook=hook: hook(m, a, {}, out)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def head_outputs(self, ids: list[int]) -> dict[int, torch.Tensor]:
        """layer -> (tokens, heads, hidden): each head's share of ``attn.out``
        (its slice of the attention output through its columns of the output
        projection; the projection's bias is no head's)."""
        out: dict[int, torch.Tensor] = {}
        handles = [layer.self_attention.core_attention.register_forward_hook(
            lambda _m, _a, z, layer=layer: out.__setitem__(
                int(layer.layer_number), per_head(z, layer.self_attention.linear_proj.weight,
                                                  int(self.model.config.kv_channels))))
            for layer in self.model.decoder.layers]
        try:
            self.forward(ids)
        finally:
            for h in handles:
                h.remove()
        return self.shared(out, "heads", head_axis=1)

    def shared(self, local: dict[Any, torch.Tensor], split: str,
               head_axis: int = 0) -> dict[Any, torch.Tensor]:
        """Tensors computed on this rank, whole (one rank holds them all)."""
        return local

    def readout(self) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
        """The final norm's weight, bias and epsilon, and the unembedding
        (vocab, hidden), from the checkpoint (whole, whatever the split)."""
        state = self.ckpt.state
        return (np.asarray(state["decoder.final_layernorm.weight"], np.float64),
                np.asarray(state["decoder.final_layernorm.bias"], np.float64),
                float(self.model.config.layernorm_epsilon),
                np.asarray(state["output_layer.weight"], np.float64))

    def final_logits(self, resid: torch.Tensor) -> np.ndarray:
        """(tokens, hidden) residual stream -> (tokens, vocab) through the final
        norm and the unembedding: the logit lens."""
        with torch.no_grad():
            x = self.model.decoder.final_layernorm(resid[:, None, :].float())
            return self.model.output_layer(x)[0][:, 0].double().numpy()


def _site_hook(access: Any, key: tuple[str, int], seen: dict[tuple[str, int], torch.Tensor],
               patch: Patch | None) -> Any:
    def hook(_m: Any, args: tuple, kwargs: dict, output: Any = None) -> Any:
        value, _ = access.get(args, kwargs, output)
        result = None
        if patch is not None:
            value = value.clone()
            value[position_index(value, access.layout, patch.position)] = patch.value
            result = access.put(args, kwargs, output, value)
        seen[key] = value.detach().clone()  # a later layer may add into it in place
        return result
    return hook


def per_head(z: torch.Tensor, proj: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Core attention output [s, b, heads * head_dim] and the output
    projection's weight [hidden, heads * head_dim] -> (s, heads, hidden) of
    sample 0: what each head adds to the residual stream."""
    per = z[:, 0].reshape(z.shape[0], -1, head_dim)
    return torch.einsum("snd,hnd->snh", per, proj.reshape(proj.shape[0], -1, head_dim))


def position_index(t: torch.Tensor, layout: str, position: int) -> tuple[Any, ...]:
    """Index of one token position's slice of a site's tensor."""
    index: list[Any] = [slice(None)] * t.dim()
    index[POSITION_AXIS[layout]] = position
    return tuple(index)


def run_with_cache(checkpoint: str | Path, prompt: str,
                   sites: Sequence[str] | None = None) -> ActivationCache:
    """Run ``prompt`` through the checkpoint's model once (CPU) and keep every
    site (or ``sites``) at every layer, by the capture's names."""
    with one_rank():
        m = LoadedModel.load(checkpoint)
        ids = m.encode(prompt)
        logits, seen = m.forward(ids, m.sites(sites))
    return ActivationCache(prompt, m.decode(ids), logits,
                           {k: _batchless(v, ACCESS[k[0]].layout) for k, v in seen.items()})


def capture_of(target: str | Path) -> Path:
    """Where results computed from a run go: beside its capture."""
    return find_capture(target, "RUN_DIR")
