"""Megatron-LM's vocabulary-parallel output layer and cross-entropy written
by hand (Shoeybi et al., "Megatron-LM", 2019: ``VocabParallelCrossEntropy``
of ``megatron.core.tensor_parallel``) over a tensor-parallel group of all
four ranks (``dist.new_group``, described as Megatron-core describes its
tensor-parallel group): each rank holds a quarter of the vocabulary's
output embedding rows and computes its quarter of every token's logits;
the logits are never gathered. The cross-entropy is an autograd function
written as Megatron's: the largest logit of each token (``all_reduce``
with MAX) is taken off every logit, the target's logit is picked by the
rank whose quarter holds the target (zero elsewhere; ``all_reduce``
SUM), and the sum of the exponentials is summed over the quarters
(``all_reduce`` SUM); the loss is the log of that sum less the target's
logit. Its backward needs no communication: each rank's logits'
gradient is its quarter of the softmax less one at the target, if the
target is in its quarter. The body before the output layer is shared
(every rank holds all of it and runs it on the same tokens): token and
position embeddings, two pre-norm residual MLP blocks and a final
LayerNorm, a token-wise language model over windows of a Markov chain.
Each rank's backward carries only its quarter of the vocabulary's share
of the loss into the body, so the body's gradients are summed over the
group (one ``all_reduce`` of them all, flattened), where Megatron
all-reduces the gradient of the output layer's input instead; the
output rows' gradients stay with their rank. AdamW. Every rank reads the
same sequences (a DataLoader).

    PYTHONPATH=tests/zoo python tests/zoo_heldout14/vocab_parallel_cross_entropy_tp4.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Step, batches, grow, main
from job_parts import FeedForwardBlock, flat_gradients, markov_sequences, unflatten_gradients

VOCAB, CONTEXT, WIDTH, BLOCKS = 2048, 32, 128, 2
BATCH, SEQUENCES = 16, 4096


class VocabParallelCrossEntropy(torch.autograd.Function):
    """The cross-entropy of each row of logits split over the group's ranks
    by vocabulary (this rank's ``[first, first + columns)``)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, first: int,
                group: dist.ProcessGroup) -> torch.Tensor:
        largest = logits.max(-1).values
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        logits = logits - largest[:, None]
        local = targets - first
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(outside, 0)
        target_logits = logits.gather(1, local[:, None]).squeeze(1).masked_fill(outside, 0.0)
        dist.all_reduce(target_logits, group=group)
        exponentials = logits.exp()
        sums = exponentials.sum(-1)
        dist.all_reduce(sums, group=group)
        ctx.save_for_backward(exponentials / sums[:, None], local, outside)
        return sums.log() - target_logits

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, outside = ctx.saved_tensors
        logits_grad = softmax.clone()
        rows = torch.arange(len(local))
        logits_grad[rows, local] -= (~outside).to(softmax.dtype)
        return logits_grad * grad[:, None], None, None, None


class Body(nn.Module):
    """Token and position embeddings, pre-norm MLP blocks, a final LayerNorm."""

    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(FeedForwardBlock(WIDTH, 4, F.gelu) for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1]))
        # the slowed rank runs its blocks on extra sequences
        x = grow(x, self.rank, self.opts)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def build(rank: int, opts: Options) -> Step:
    world = dist.get_world_size()
    group = dist.new_group(list(range(world)), group_desc="TENSOR_MODEL_PARALLEL_GROUP")
    torch.manual_seed(0)  # the same body and whole output layer everywhere
    body = Body(rank, opts)
    rows = VOCAB // world
    output = nn.Parameter(nn.Linear(WIDTH, VOCAB, bias=False).weight.detach()
                          [rank * rows:(rank + 1) * rows].clone())
    shared = list(body.parameters())
    optimizer = torch.optim.AdamW([*shared, output], lr=1e-3, weight_decay=0.01, fused=True)
    # the vocabulary is split, not the batch: every rank reads the same sequences
    data = batches(markov_sequences(VOCAB, SEQUENCES, CONTEXT), rank, opts, BATCH,
                   replicas=1, replica=0)

    def step(_: int) -> None:
        tokens, targets = next(data)
        optimizer.zero_grad()
        hidden = body(tokens)
        logits = F.linear(hidden, output)[:len(tokens)]  # this rank's quarter of the vocabulary
        losses = VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(),
                                                 rank * rows, group)
        losses.mean().backward()
        flat = flat_gradients(shared)
        dist.all_reduce(flat, group=group)
        unflatten_gradients(flat, shared)
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
