"""Which transformer layers each pipeline stage and model chunk holds.

Follows megatron-core's ``get_num_layers_to_build``
(megatron/core/transformer/transformer_block.py) and the rules of
``TransformerConfig.__post_init__`` (megatron/core/transformer/transformer_config.py):
an even split by default; ``decoder_first_pipeline_num_layers`` /
``decoder_last_pipeline_num_layers`` fix the first / last stage's layers and
the middle stages share the rest evenly; ``account_for_embedding_in_pipeline_split``
(``..._loss_...``) counts the embedding (the loss) as one more layer, taken from
the first (last) model chunk. Virtual stages run in model order
``chunk·pp + pp_rank``; each stage's layers are split evenly over its chunks.
"""
from __future__ import annotations

from typing import Protocol


class PipelineOptions(Protocol):
    """The keys of ``parallel`` the split reads (read-only: scenarios are frozen)."""

    @property
    def pp(self) -> int: ...
    @property
    def vpp(self) -> int: ...
    @property
    def decoder_first_pipeline_num_layers(self) -> int | None: ...
    @property
    def decoder_last_pipeline_num_layers(self) -> int | None: ...
    @property
    def account_for_embedding_in_pipeline_split(self) -> bool: ...
    @property
    def account_for_loss_in_pipeline_split(self) -> bool: ...


def is_uneven(p: PipelineOptions) -> bool:
    return (p.decoder_first_pipeline_num_layers is not None
            or p.decoder_last_pipeline_num_layers is not None)


def _accounts(p: PipelineOptions) -> int:
    """Layers the embedding and the loss count for in the split."""
    return int(p.account_for_embedding_in_pipeline_split) + int(p.account_for_loss_in_pipeline_split)


def is_default(p: PipelineOptions) -> bool:
    """Every chunk holds layers/(pp·vpp) layers."""
    return not is_uneven(p) and not _accounts(p)


def _middle(p: PipelineOptions, layers: int) -> tuple[int, int]:
    """(layers, stages) left for the stages without a fixed count."""
    stages = p.pp
    for fixed in (p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers):
        if fixed is not None:
            layers, stages = layers - fixed, stages - 1
    return layers, stages


def split_error(p: PipelineOptions, layers: int) -> tuple[str, str] | None:
    """(field, reason) for a split megatron-core refuses, else None."""
    first = "parallel.decoder_first_pipeline_num_layers"
    if is_uneven(p) and _accounts(p):
        return (first if p.decoder_first_pipeline_num_layers is not None
                else "parallel.decoder_last_pipeline_num_layers",
                "cannot be set together with account_for_embedding/loss_in_pipeline_split")
    if (is_uneven(p) or _accounts(p)) and p.pp == 1:
        return "parallel.pp", "an uneven pipeline split needs pp > 1"
    if not is_uneven(p):
        total = layers + _accounts(p)
        if total % (p.pp * p.vpp):
            what = f"{total} (the embedding/loss counted as layers)" if _accounts(p) else f"{total}"
            return "model.layers", f"{what} is not divisible by pp*vpp = {p.pp * p.vpp}"
        return None
    for key in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        fixed = getattr(p, key)
        if fixed is not None and fixed % p.vpp:
            return f"parallel.{key}", f"{fixed} is not divisible by vpp = {p.vpp}"
    rest, stages = _middle(p, layers)
    if rest < 0 or bool(rest) != bool(stages):
        return first, (f"the first and last stages' layers leave {rest} layers for "
                       f"{stages} middle stages (model.layers = {layers})")
    if stages and rest % (stages * p.vpp):
        return first, (f"the {rest} layers left are not divisible by the {stages} middle "
                       f"stages times vpp = {p.vpp}")
    return None


def stage_layers(p: PipelineOptions, layers: int, pp_rank: int) -> int:
    """Layers of pipeline stage ``pp_rank``, before the embedding/loss is taken out."""
    if not is_uneven(p):
        return (layers + _accounts(p)) // p.pp
    if pp_rank == 0 and p.decoder_first_pipeline_num_layers is not None:
        return p.decoder_first_pipeline_num_layers
    if pp_rank == p.pp - 1 and p.decoder_last_pipeline_num_layers is not None:
        return p.decoder_last_pipeline_num_layers
    rest, stages = _middle(p, layers)
    return rest // stages


def chunk_layers(p: PipelineOptions, layers: int, pp_rank: int, chunk: int) -> int:
    """Transformer layers model chunk ``chunk`` of stage ``pp_rank`` builds."""
    count = stage_layers(p, layers, pp_rank) // p.vpp
    if p.account_for_embedding_in_pipeline_split and pp_rank == 0 and chunk == 0:
        count -= 1
    if p.account_for_loss_in_pipeline_split and pp_rank == p.pp - 1 and chunk == p.vpp - 1:
        count -= 1
    return count


def first_layer(p: PipelineOptions, layers: int, pp_rank: int, chunk: int) -> int:
    """Global number of the chunk's first layer: the layers of the virtual stages before it."""
    before = range(chunk * p.pp + pp_rank)
    return sum(chunk_layers(p, layers, vs % p.pp, vs // p.pp) for vs in before)


def rank_chunk_layers(p: PipelineOptions, layers: int, pp_rank: int) -> list[int]:
    return [chunk_layers(p, layers, pp_rank, c) for c in range(p.vpp)]


def max_chunk_layers(p: PipelineOptions, layers: int) -> int:
    return max(max(rank_chunk_layers(p, layers, r)) for r in range(p.pp))
