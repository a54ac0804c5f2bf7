"""Megatron-LM's tensor and sequence parallelism written by hand (Shoeybi
et al., "Megatron-LM", 2019; Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", 2022), on two tensor-parallel
pairs (ranks 0 and 1, 2 and 3) that are data parallel to each other, each
group a process group of its own (``dist.new_group``, described as
Megatron-core describes its tensor- and data-parallel groups). The model
is a token-wise language model: token and position embeddings, two
pre-norm residual MLP blocks, a final LayerNorm and the language-model
head. Activations are laid out [sequence, batch, width] as in Megatron,
and between the blocks each rank of a pair holds half of every sequence
(its own consecutive positions). A block normalises its half, all-gathers
the pair's halves (``all_gather_single`` in the pair's group), runs the
column-parallel up projection (each rank half of the hidden units), GELU
and the row-parallel down projection (each rank a partial sum over its
hidden units) and reduce-scatters the partial sums back into sequence
halves (``reduce_scatter_single``); both are autograd functions written
as Megatron's are, the gather's backward a reduce-scatter, the
reduce-scatter's an all-gather. The weights every rank of a pair holds
whole (embeddings, LayerNorms, the down projection's bias, the head) see
only the rank's half of the positions, so their gradients are summed over
the pair (``all_reduce`` in its group), as Megatron does for sequence
parallel LayerNorms; then every gradient, shard or whole, is averaged
with the same one of the other pair (``all_reduce`` in a group of ranks
0 and 2, or 1 and 3) and Adam steps. The two ranks of a pair read the
same sequences, the pair's share of them (a DataLoader with a
DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout13/megatron_sequence_parallel_tp2_dp2.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Rows, Step, average_gradients, batches, grow, main
from job_parts import markov_sequences

VOCAB, CONTEXT, WIDTH, HIDDEN, BLOCKS = 512, 64, 128, 512, 2
TP, BATCH, SEQUENCES = 2, 16, 4096


def gathered(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The group's sequence shards of ``x`` joined along the sequence, in rank order."""
    whole = torch.empty(x.shape[0] * dist.get_world_size(group), *x.shape[1:])
    dist.all_gather_single(whole, x.contiguous(), group=group)
    return whole


def scattered(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's shard of the sequence of ``x`` summed over the group."""
    shard = torch.empty(x.shape[0] // dist.get_world_size(group), *x.shape[1:])
    dist.reduce_scatter_single(shard, x.contiguous(), group=group)
    return shard


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return gathered(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return scattered(grad, ctx.group), None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return scattered(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gathered(grad, ctx.group), None


def column_parallel(full: nn.Linear, index: int) -> nn.Linear:
    """Part ``index`` of ``full``'s output units (its weight's rows and its bias)."""
    part = nn.Linear(full.in_features, full.out_features // TP)
    with torch.no_grad():
        part.weight.copy_(full.weight.chunk(TP, 0)[index])
        part.bias.copy_(full.bias.chunk(TP)[index])
    return part


def row_parallel(full: nn.Linear, index: int) -> nn.Linear:
    """Part ``index`` of ``full``'s input units (its weight's columns), without a bias."""
    part = nn.Linear(full.in_features // TP, full.out_features, bias=False)
    with torch.no_grad():
        part.weight.copy_(full.weight.chunk(TP, 1)[index])
    return part


class ParallelBlock(nn.Module):
    def __init__(self, index: int, group: dist.ProcessGroup, rank: int, opts: Options) -> None:
        super().__init__()
        self.group, self.rank, self.opts = group, rank, opts
        self.norm = nn.LayerNorm(WIDTH)
        up, down = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)
        self.up, self.down = column_parallel(up, index), row_parallel(down, index)
        self.down_bias = nn.Parameter(down.bias.detach().clone())  # added once, after the sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        whole = GatherFromSequenceParallelRegion.apply(self.norm(x), self.group)
        # the slowed rank projects extra sequence positions of its own
        partial = self.down(F.gelu(self.up(grow(whole, self.rank, self.opts))))[:len(whole)]
        return x + ReduceScatterToSequenceParallelRegion.apply(partial, self.group) + self.down_bias


class LanguageModel(nn.Module):
    def __init__(self, index: int, group: dist.ProcessGroup, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.Sequential(*(ParallelBlock(index, group, rank, opts)
                                      for _ in range(BLOCKS)))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, first: int) -> torch.Tensor:
        """The logits of a sequence shard ([positions, batch]) that starts at ``first``."""
        positions = self.positions(torch.arange(first, first + len(tokens)))
        x = self.blocks(self.tokens(tokens) + positions[:, None])
        return self.head(grow(self.norm(x), self.rank, self.opts))[:len(x)]


def build(rank: int, opts: Options) -> Step:
    pairs = dist.get_world_size() // TP
    pair, index = divmod(rank, TP)
    # every rank creates every group, in the same order
    tp_groups = [dist.new_group([p * TP + i for i in range(TP)],
                                group_desc="TENSOR_MODEL_PARALLEL_GROUP") for p in range(pairs)]
    dp_groups = [dist.new_group([p * TP + i for p in range(pairs)],
                                group_desc="DATA_PARALLEL_GROUP") for i in range(TP)]
    tp_group, dp_group = tp_groups[pair], dp_groups[index]
    torch.manual_seed(0)  # the same whole weights everywhere, each rank its part
    model = LanguageModel(index, tp_group, rank, opts)
    sharded = {p for block in model.modules() if isinstance(block, ParallelBlock)
               for p in (block.up.weight, block.up.bias, block.down.weight)}
    whole = [p for p in model.parameters() if p not in sharded]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = batches(markov_sequences(VOCAB, SEQUENCES, CONTEXT), rank, opts, BATCH,
                   replicas=pairs, replica=pair)
    shard = CONTEXT // TP
    first = index * shard

    def step(_: int) -> None:
        tokens, targets = (t.t()[first:first + shard] for t in next(data))
        optimizer.zero_grad()
        logits = model(tokens, first)
        (F.cross_entropy(logits.flatten(0, 1), targets.flatten()) / TP).backward()
        for p in whole:  # each rank saw its half of the positions
            assert p.grad is not None
            dist.all_reduce(p.grad, group=tp_group)
        average_gradients(model.parameters(), dp_group)
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
