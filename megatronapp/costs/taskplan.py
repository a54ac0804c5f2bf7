"""What one pipeline task does, step by step: compute pieces, the tensor-parallel
collectives between them, and overlapped gradient buckets.

Megatron's layer runs its attention block, then its MLP block; with tensor
parallelism each block ends (forward) or starts (backward) with a collective
on the tp group: an all-reduce, or under sequence parallelism an all-gather
before and a reduce-scatter after the block. So a forward task on a chunk of
L layers is, per layer: [attention, all-reduce, MLP, all-reduce] (sequence
parallel: [all-gather, attention, reduce-scatter, all-gather, MLP,
reduce-scatter]); backward visits layers and blocks in reverse, full
recomputation first repeating each layer's forward. A throttled tp rank thus
arrives last at every one of its layer's collectives, as in a real trace.

Pieces of one task share the task's name; ``part``/``parts`` (in meta) number
them, so a task starts with its part 0 and ends with its last part.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from .per_op import StageCosts


@dataclass(frozen=True)
class Work:
    name: str  # forward | recompute_forward | backward
    cost_s: float
    layer: int | None = None


@dataclass(frozen=True)
class TpCollective:
    kind: str  # all_reduce | reduce_scatter | all_gather
    layer: int


@dataclass(frozen=True)
class GradBucket:
    """Post the reduction of the next ``nbytes`` of gradients (overlap_grad_reduce)."""

    nbytes: int
    index: int


Step = Union[Work, TpCollective, GradBucket]


def _block(kinds: tuple[str, ...], half: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(collectives before, after) one block's compute; ``half`` 0 or 1 picks the
    block's share of the layer's collectives."""
    mine = kinds[len(kinds) // 2 * half:len(kinds) // 2 * (half + 1)]
    if len(mine) == 2:  # sequence parallel: gather before, scatter after (or reverse)
        return mine[:1], mine[1:]
    return (), mine


def layer_steps(name: str, layer: int, cost_s: float, kinds: tuple[str, ...],
                first_share: float) -> list[Step]:
    """One layer's two blocks with their collectives (``kinds`` in issue order)."""
    if not kinds:
        return [Work(name, cost_s, layer)]
    steps: list[Step] = []
    for half, share in ((0, first_share), (1, 1.0 - first_share)):
        before, after = _block(kinds, half)
        steps += [TpCollective(k, layer) for k in before]
        steps.append(Work(name, cost_s * share, layer))
        steps += [TpCollective(k, layer) for k in after]
    return steps


def forward_plan(c: StageCosts, first_layer: int, extra_before: float, extra_after: float,
                 tp_ops: bool) -> list[Step]:
    """A forward task: ``extra_before`` (embedding) and ``extra_after`` (output
    layer) go to the first and last piece."""
    if not tp_ops or not c.tp_layer_forward or c.layers_per_chunk == 0:
        return [Work("forward", c.forward_chunk_s + extra_before + extra_after)]
    per_layer = c.forward_chunk_s / c.layers_per_chunk
    steps: list[Step] = []
    for layer in range(first_layer, first_layer + c.layers_per_chunk):
        steps += layer_steps("forward", layer, per_layer, c.tp_layer_forward, c.attention_share)
    return _add_to_ends(steps, "forward", extra_before, extra_after)


def backward_plan(c: StageCosts, first_layer: int, extra_before: float, extra_after: float,
                  tp_ops: bool, buckets: list[int]) -> list[Step]:
    """A backward task, layers in reverse; ``buckets`` (gradient bytes, in the
    order they fill) are posted as soon as their layers' backward is done."""
    layers = c.layers_per_chunk
    split = tp_ops and bool(c.tp_layer_backward) and layers > 0
    recompute = c.recompute_chunk_s > 0 or c.tp_recompute
    if not split:
        steps: list[Step] = []
        if recompute:
            steps.append(Work("recompute_forward", c.recompute_chunk_s))
        steps += _bucketed_work(c.backward_chunk_s + extra_before + extra_after, buckets)
        return steps
    steps = []
    per_bwd = c.backward_chunk_s / layers
    per_rc = c.recompute_chunk_s / c.recompute_layers if c.recompute_layers else 0.0
    done, posted = 0.0, 0
    total = float(sum(buckets))
    for i, layer in enumerate(reversed(range(first_layer, first_layer + layers))):
        if recompute and layer - first_layer < c.recompute_layers:
            kinds = c.tp_layer_forward if c.tp_recompute else ()
            steps += layer_steps("recompute_forward", layer, per_rc, kinds, c.attention_share)
        steps += layer_steps("backward", layer, per_bwd, c.tp_layer_backward,
                             1.0 - c.attention_share)
        done = total * (i + 1) / layers
        while posted < len(buckets) and sum(buckets[:posted + 1]) <= done + 1e-9:
            steps.append(GradBucket(buckets[posted], posted))
            posted += 1
    steps = _add_to_ends(steps, "backward", extra_before, extra_after)
    steps += [GradBucket(b, k) for k, b in enumerate(buckets) if k >= posted]
    return steps


def _bucketed_work(cost_s: float, buckets: list[int]) -> list[Step]:
    """One backward piece per gradient bucket, each followed by its reduction."""
    if not buckets:
        return [Work("backward", cost_s)]
    total = sum(buckets)
    steps: list[Step] = []
    for k, nbytes in enumerate(buckets):
        steps += [Work("backward", cost_s * nbytes / total), GradBucket(nbytes, k)]
    return steps


def _add_to_ends(steps: list[Step], name: str, before: float, after: float) -> list[Step]:
    works = [i for i, st in enumerate(steps) if isinstance(st, Work) and st.name == name]
    out = list(steps)
    for i, extra in ((works[0], before), (works[-1], after)):
        w = out[i]
        assert isinstance(w, Work)
        out[i] = Work(w.name, w.cost_s + extra, w.layer)
    return out


def bucket_sizes(total: int, bucket: int) -> list[int]:
    if bucket <= 0 or total <= bucket:
        return [total]
    full, rest = divmod(total, bucket)
    return [bucket] * full + ([rest] if rest else [])
