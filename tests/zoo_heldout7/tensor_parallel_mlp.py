"""Tensor and sequence parallelism with ``torch.distributed.tensor.parallel``,
as PyTorch's tensor-parallel tutorial plans a transformer's layers, here a
token-wise MLP language model (a neural bigram model: token embeddings, a
pre-norm residual MLP block, a final LayerNorm and the language-model
head): one ``DeviceMesh`` over the four ranks and ``parallelize_module``
with ``RowwiseParallel`` for the token embedding (each rank a quarter of
the vocabulary's rows), ``ColwiseParallel`` then ``RowwiseParallel`` for
the block's up and down projections (each rank a quarter of the hidden
units) and ``ColwiseParallel`` for the head (a quarter of the vocabulary's
logits, the cross-entropy computed under ``loss_parallel`` without
gathering them). The LayerNorms run ``SequenceParallel``: between the
layers each rank holds a quarter of every sequence's tokens, so the block
and the head all-gather the tokens before their projections and the
embedding and the block reduce-scatter their outputs; in backward the other
way round. AdamW (fused). Every rank reads the same sequences (a
DataLoader).

The slowed rank's projections run on extra sequences of its own: hooks on
each parallel linear layer, after the plan's own, add the rows to the
layer's local input and take them off its local output before the plan's
collectives see it.

    PYTHONPATH=tests/zoo python tests/zoo_heldout7/tensor_parallel_mlp.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel, loss_parallel,
                                               parallelize_module)

from launch import Options, Rows, Step, batches, main
from job_parts import ExtraRows, markov_sequences

VOCAB, CONTEXT, WIDTH, HIDDEN = 2048, 64, 128, 2048
BATCH, SEQUENCES = 8, 1024


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class BigramMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.norm1, self.mlp = nn.LayerNorm(WIDTH), FeedForward()
        self.norm2, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        x = x + self.mlp(self.norm1(x))
        return self.head(self.norm2(x))


def parallelize(model: BigramMLP, mesh: DeviceMesh) -> None:
    """The tutorial's plan: sequence parallel norms between column- and
    row-wise parallel layers, the logits split over the vocabulary."""
    parallelize_module(model, mesh, {
        "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm1": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        "norm2": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False)})


def sequences() -> Rows:
    return markov_sequences(VOCAB, SEQUENCES, CONTEXT)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)  # every rank starts from the same parameters, then keeps its share
    model = BigramMLP()
    parallelize(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    if rank in opts.slow_ranks:
        for module in (model.mlp.up, model.mlp.down, model.head):
            ExtraRows(module, rank, opts)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    # tensor parallel: every rank reads the same sequences
    data = batches(sequences(), rank, opts, BATCH, replicas=1, replica=0)

    def step(_: int) -> None:
        tokens, targets = next(data)
        optimizer.zero_grad()
        with loss_parallel():
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
