"""A DLRM-style click-through recommender with its embedding tables
sharded table-wise and its MLPs data parallel, as the DLRM reference
implementation and TorchRec lay it out: each rank holds one of the four
sparse features' ``EmbeddingBag`` tables (mode sum, bags given by offsets;
sparse gradients) and looks it up for the whole global batch; an
``all_to_all_single`` then sends each rank its own samples' pooled
embeddings from every table (in an autograd function: backward sends their
gradients back to the tables' ranks). The bottom MLP (over the dense
features) and the top MLP (over the pairwise dot products of the bottom
MLP's output and the four embeddings, and that output itself) are
replicated under DDP. Binary cross-entropy on the click; SGD, as DLRM
trains, over the sparse tables and the dense MLPs alike. Every rank reads
the same global batches (a DataLoader): its own quarter of the samples for
the MLPs, its table's column of every sample for the lookup.

    PYTHONPATH=tests/zoo python tests/zoo_heldout8/dlrm_sharded_embeddings.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

DENSE, TABLES, ROWS, DIMENSION, IDS = 13, 4, 20_000, 64, 8  # IDS: a bag's ids
BATCH, SAMPLES = 256, 16_384  # BATCH: a rank's share of the global batch


class AllToAll(torch.autograd.Function):
    """Each rank's i-th block of rows goes to rank i; backward likewise."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return AllToAll.apply(grad)


def mlp(*widths: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class DenseArch(nn.Module):
    """The bottom MLP, the feature interaction and the top MLP. The slowed
    rank runs both MLPs on extra samples."""

    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.bottom = mlp(DENSE, 512, 256, DIMENSION)
        features = TABLES + 1
        self.top = mlp(DIMENSION + features * (features - 1) // 2, 512, 256, 1)
        self.pairs = torch.triu_indices(features, features, offset=1)

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        x = self.bottom(grow(dense, self.rank, self.opts))[:len(dense)]
        vectors = torch.cat([x.unsqueeze(1), embedded], 1)  # (batch, 1 + tables, dimension)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        z = torch.cat([x, dots], 1)
        return self.top(grow(z, self.rank, self.opts))[:len(dense)].squeeze(1)


def clicks() -> Rows:
    """Dense features, one bag of ids per table (ids drawn by a power law,
    as categorical features are) and a click that depends on both."""
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(SAMPLES, DENSE, generator=g)
    ids = (ROWS * torch.rand(SAMPLES, TABLES, IDS, generator=g) ** 3).long()
    weights = torch.randn(DENSE, generator=g)
    popular = (ids < 100).float().mean((1, 2))
    labels = (dense @ weights / DENSE ** 0.5 + 4 * popular
              + 0.5 * torch.randn(SAMPLES, generator=g) > 0.5).float()
    return Rows(dense, ids, labels)


def build(rank: int, opts: Options) -> Step:
    world = dist.get_world_size()
    assert world == TABLES  # one table per rank
    torch.manual_seed(1 + rank)
    table = nn.EmbeddingBag(ROWS, DIMENSION, mode="sum", sparse=True)
    torch.manual_seed(0)
    dense = DistributedDataParallel(DenseArch(rank, opts))
    optimizer = torch.optim.SGD([*table.parameters(), *dense.parameters()], lr=0.05)
    # every rank reads the global batch: the lookups are model parallel
    data = batches(clicks(), rank, opts, BATCH * world, replicas=1, replica=0)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)

    def step(_: int) -> None:
        features, ids, labels = next(data)
        optimizer.zero_grad()
        bags = ids[:, rank]  # this rank's table's bags, for every sample
        offsets = torch.arange(0, bags.numel(), IDS)
        pooled = table(bags.flatten(), offsets)  # (world x batch, dimension)
        # block i: rank i's samples' lookups; back, each rank's samples from every table
        embedded = AllToAll.apply(pooled).view(world, BATCH, DIMENSION).transpose(0, 1)
        logits = dense(features[mine], embedded)
        F.binary_cross_entropy_with_logits(logits, labels[mine]).backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
