"""Everything about the names of a hooked model's activations lives here.

The model object (``megatronapp.scope.load``) names its hook points as
TransformerLens does: ``hook_embed``, ``hook_pos_embed``, then per block ``l``
(counted from 0) ``blocks.{l}.hook_resid_pre``, ``blocks.{l}.attn.hook_q`` /
``hook_k`` / ``hook_v`` / ``hook_pattern`` / ``hook_z``, ``blocks.{l}.hook_attn_out``,
``hook_resid_mid``, ``blocks.{l}.mlp.hook_pre`` / ``hook_post``, ``hook_mlp_out``,
``hook_resid_post``. A hook point is also reached by TransformerLens's short
form ``("pattern", 0)`` and by MegaScope's own site names ``("attn.probs", 0)``;
every layer index counts from 0 here (a capture's ``layer`` column is the
block index plus 1, megatron's ``layer_number``).

Tensors at a hook point have TransformerLens's layout: ``[batch, pos, ...]``,
``[batch, pos, head, d_head]`` for q/k/v/z and ``[batch, head, query, key]``
for the pattern. ``TP_SPLIT`` says how each splits over tensor parallelism.
No torch here.
"""
from __future__ import annotations

import re
from typing import Callable, Iterable, Sequence, Union

from ..errors import UserError
from ..io.suggest import did_you_mean

# MegaScope site -> the hook point's name inside block l (forward order)
BLOCK_HOOKS: dict[str, str] = {
    "resid_pre": "hook_resid_pre",
    "attn.q": "attn.hook_q", "attn.k": "attn.hook_k", "attn.v": "attn.hook_v",
    "attn.probs": "attn.hook_pattern",
    "attn.z": "attn.hook_z",
    "attn.out": "hook_attn_out",
    "resid_mid": "hook_resid_mid",
    "mlp.pre": "mlp.hook_pre", "mlp.post": "mlp.hook_post",
    "mlp.out": "hook_mlp_out",
    "resid_post": "hook_resid_post",
}
MODEL_HOOKS: dict[str, str] = {"embed": "hook_embed", "pos_embed": "hook_pos_embed"}
# TransformerLens's short names (utils.get_act_name) -> MegaScope's site
SHORT: dict[str, str] = {
    "resid_pre": "resid_pre", "resid_mid": "resid_mid", "resid_post": "resid_post",
    "q": "attn.q", "k": "attn.k", "v": "attn.v", "pattern": "attn.probs", "z": "attn.z",
    "attn_out": "attn.out", "pre": "mlp.pre", "post": "mlp.post", "mlp_out": "mlp.out",
    "embed": "embed", "pos_embed": "pos_embed",
}
# how a hook point's tensor splits over TP ranks: (what, axis in the layout above)
TP_SPLIT: dict[str, tuple[str, int]] = {
    "attn.q": ("heads", 2), "attn.k": ("heads", 2), "attn.v": ("heads", 2),
    "attn.z": ("heads", 2), "attn.probs": ("heads", 1),
    "mlp.pre": ("channels", -1), "mlp.post": ("channels", -1),
}

Key = Union[str, tuple[str, int]]
NamesFilter = Union[None, str, Sequence[str], Callable[[str], bool]]
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_SITE_OF_HOOK = {hook: site for site, hook in BLOCK_HOOKS.items()}
_SITE_OF_MODEL_HOOK = {hook: site for site, hook in MODEL_HOOKS.items()}


def all_hook_names(layers: int) -> list[str]:
    """Every hook point of a ``layers``-block model, in forward order."""
    return [*MODEL_HOOKS.values(),
            *(f"blocks.{n}.{hook}" for n in range(layers) for hook in BLOCK_HOOKS.values())]


def site_of(name: str) -> tuple[str, int | None]:
    """``blocks.1.attn.hook_pattern`` -> ("attn.probs", 1); ``hook_embed`` -> ("embed", None)."""
    if name in _SITE_OF_MODEL_HOOK:
        return _SITE_OF_MODEL_HOOK[name], None
    match = _BLOCK.fullmatch(name)
    if match is None or match.group(2) not in _SITE_OF_HOOK:
        raise KeyError(name)
    return _SITE_OF_HOOK[match.group(2)], int(match.group(1))


def hook_name(key: Key, layers: int, field: str = "name") -> str:
    """The hook point ``key`` names: a full name, or (short or site name, layer)
    with the layer counted from 0 (negative from the end). One-line error."""
    if isinstance(key, str):
        try:
            site_of(key)
        except KeyError:
            raise UserError(f"{field}: no hook point {key!r}"
                            f"{did_you_mean(key, all_hook_names(layers))}") from None
        if (n := site_of(key)[1]) is not None and n >= layers:
            raise UserError(f"{field}: {key!r}: the model has blocks 0..{layers - 1}")
        return key
    site, layer = key
    site = SHORT.get(site, site)
    if site in MODEL_HOOKS:
        return MODEL_HOOKS[site]
    if site not in BLOCK_HOOKS:
        raise UserError(f"{field}: unknown site {site!r}"
                        f"{did_you_mean(site, [*SHORT, *BLOCK_HOOKS])}")
    if not -layers <= int(layer) < layers:
        raise UserError(f"{field}: layer {layer} out of range (blocks 0..{layers - 1})")
    return f"blocks.{int(layer) % layers}.{BLOCK_HOOKS[site]}"


def matching(names_filter: NamesFilter, layers: int) -> list[str]:
    """The hook points a TransformerLens ``names_filter`` keeps: None (all), a
    name, a list of names, or a predicate on names; in forward order."""
    every = all_hook_names(layers)
    if names_filter is None:
        return every
    if callable(names_filter):
        return [n for n in every if names_filter(n)]
    wanted = [names_filter] if isinstance(names_filter, str) else list(names_filter)
    chosen = {hook_name(n, layers, "names_filter") for n in wanted}
    return [n for n in every if n in chosen]


def site_names(sites: Iterable[str], layers: int, field: str = "sites") -> list[str]:
    """Every block's hook point of each site (short or MegaScope name)."""
    return [hook_name((site, n), layers, field) for site in sites for n in range(layers)]
