"""DDP fed by one reader: rank 0 alone reads the data (a DataLoader over
the whole data set, a batch for all four ranks at a time), cuts each batch
into four shards and hands each rank its own with ``dist.scatter``, the
features and then the labels, as the "Writing Distributed Applications"
tutorial's scatter does. Every rank then takes a DDP step on its shard: a
residual MLP classifier of tabular rows (categorical columns embedded,
numerical ones normalised, LayerNorm residual blocks), cross-entropy,
gradients clipped to a norm of 1 with ``clip_grad_norm_`` after DDP has
averaged them, then Adam (fused).

    PYTHONPATH=tests/zoo python tests/zoo_heldout10/scatter_fed_ddp.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

CATEGORIES, CARDINALITY, NUMERICAL, CLASSES = 4, 32, 16, 8
WIDTH, BLOCKS, SHARD, ROWS = 512, 2, 128, 16384


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(),
                                 nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TabularNet(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.embeddings = nn.Embedding(CATEGORIES * CARDINALITY, 16)
        self.numerical = nn.LayerNorm(NUMERICAL)
        self.inputs = nn.Linear(CATEGORIES * 16 + NUMERICAL, WIDTH)
        self.blocks = nn.Sequential(*(Block() for _ in range(BLOCKS)))
        self.classifier = nn.Linear(WIDTH, CLASSES)

    def forward(self, categorical: torch.Tensor, numerical: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(CATEGORIES) * CARDINALITY
        x = torch.cat([self.embeddings(categorical + offsets).flatten(1),
                       self.numerical(numerical)], dim=1)
        # the slowed rank runs the layers on extra rows
        return self.classifier(self.blocks(self.inputs(grow(x, self.rank, self.opts))))[:len(x)]


def table() -> Rows:
    """Rows of categorical and numerical columns; the class depends on both."""
    g = torch.Generator().manual_seed(0)
    categorical = torch.randint(0, CARDINALITY, (ROWS, CATEGORIES), generator=g)
    numerical = torch.randn(ROWS, NUMERICAL, generator=g)
    weights = torch.randn(CATEGORIES, CARDINALITY, CLASSES, generator=g)
    projection = torch.randn(NUMERICAL, CLASSES, generator=g)
    scores = weights[torch.arange(CATEGORIES), categorical].sum(1) + numerical @ projection
    return Rows(categorical, numerical, scores.argmax(1))


def build(rank: int, opts: Options) -> Step:
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(TabularNet(rank, opts))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    # rank 0 reads a batch for every rank at once; the others only receive
    data = (batches(table(), rank, opts, SHARD * world, replicas=1, replica=0)
            if rank == 0 else None)

    def scattered(batch: torch.Tensor | None, shape: tuple[int, ...],
                  dtype: torch.dtype) -> torch.Tensor:
        shard = torch.empty(shape, dtype=dtype)
        dist.scatter(shard, None if batch is None else list(batch.chunk(world)), src=0)
        return shard

    def step(_: int) -> None:
        categorical, numerical, labels = next(data) if data is not None else (None, None, None)
        categorical = scattered(categorical, (SHARD, CATEGORIES), torch.long)
        numerical = scattered(numerical, (SHARD, NUMERICAL), torch.float)
        labels = scattered(labels, (SHARD,), torch.long)
        optimizer.zero_grad()
        F.cross_entropy(model(categorical, numerical), labels).backward()
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
