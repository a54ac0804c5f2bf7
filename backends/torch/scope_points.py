"""The model object's hook points on megatron-core's modules (``megatronapp.scope.names``).

Each hook point is one of MegaScope's site hooks (``scope.ACCESS``) plus the
two it lacks (the attention's per-head output ``attn.z``, the token and
position embeddings), and a conversion between megatron's layout (``[s, b,
...]``) and TransformerLens's (``[b, s, ...]``). ``attach`` puts a PyTorch hook
on every requested point of one model (a whole model or one pipeline stage):
the hook hands the point's tensor, in TransformerLens's layout, to ``visit``
(``visit(name, tensor) -> tensor | None``) and puts back what it returns. The
hooks are removed when the context ends; the model itself is never edited.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from megatronapp.scope.names import site_of

from .scope import ACCESS, HEAD_MASK, SiteAccess

Tensor = torch.Tensor
Visit = Callable[[str, Tensor], "Tensor | None"]


def _output() -> tuple[Callable, Callable]:
    return lambda a, kw, out: (out, out), lambda a, kw, out, new: new


EMBED = SiteAccess(lambda m: m.embedding.word_embeddings, False, "bsh", *_output())
POS_EMBED = SiteAccess(lambda m: m.embedding.position_embeddings, False, "bsh", *_output())
POINTS: dict[str, SiteAccess] = {**{s: a for s, a in ACCESS.items() if s != "logits"},
                                 "attn.z": HEAD_MASK, "embed": EMBED, "pos_embed": POS_EMBED}


@dataclass(frozen=True)
class Layout:
    """megatron's layout <-> TransformerLens's for one layout name."""

    layout: str
    head_dim: int

    def to_lens(self, x: Tensor) -> Tensor:
        if self.layout in ("sbh", "sbnh"):
            return x.transpose(0, 1)
        if self.layout == "sb(nh)":  # [s, b, n·d] -> [b, s, n, d]
            return x.transpose(0, 1).reshape(x.shape[1], x.shape[0], -1, self.head_dim)
        return x  # bnsk, bsh: already

    def from_lens(self, y: Tensor) -> Tensor:
        if self.layout in ("sbh", "sbnh"):
            return y.transpose(0, 1)
        if self.layout == "sb(nh)":
            return y.reshape(y.shape[0], y.shape[1], -1).transpose(0, 1)
        return y


def _module_of(model: Any, site: str, layer: int | None) -> tuple[Any, SiteAccess] | None:
    """The module hooked for ``site`` at block ``layer`` (index within the
    whole model) if this model (stage) holds it."""
    access = POINTS[site]
    if layer is None:
        return (access.module(model), access) if getattr(model, "pre_process", True) else None
    for block in model.decoder.layers:
        if int(block.layer_number) - 1 == layer:
            return access.module(block), access
    return None


def held_names(model: Any, names: Sequence[str]) -> list[str]:
    """Which of ``names`` this model (stage) holds."""
    return [n for n in names if _module_of(model, *site_of(n)) is not None]


def _hook(name: str, access: SiteAccess, layout: Layout, visit: Visit) -> Callable[..., Any]:
    def run(args: tuple, kwargs: dict, output: Any) -> Any:
        value, _ = access.get(args, kwargs, output)
        new = visit(name, layout.to_lens(value))
        if new is None:
            return None
        return access.put(args, kwargs, output, layout.from_lens(new).to(value.dtype).contiguous())
    return run


@contextlib.contextmanager
def attached(model: Any, names: Sequence[str], visit: Visit, head_dim: int) -> Iterator[None]:
    """Hooks on every point of ``names`` this model holds, for the context."""
    handles = []
    for name in held_names(model, names):
        module, access = _module_of(model, *site_of(name))  # type: ignore[misc]
        run = _hook(name, access, Layout(access.layout, head_dim), visit)
        if access.pre:
            handles.append(module.register_forward_pre_hook(
                lambda _m, a, kw, run=run: run(a, kw, None), with_kwargs=True))
        else:
            handles.append(module.register_forward_hook(
                lambda _m, a, out, run=run: run(a, {}, out)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
