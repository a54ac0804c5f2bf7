"""A click-through recommender under DDP, after DLRM: each sparse feature
(a bag of category ids per sample) is pooled by an ``EmbeddingBag`` of its
own (mode sum, bags given by offsets), the dense features by a bottom MLP;
their pairwise dot products and the dense vector feed a top MLP that
predicts a click (binary cross-entropy). Adagrad, as recommenders use; the
samples a DataLoader reads with a DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout2/ddp_embedding_bag.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

TABLES, ROWS, DIM, IDS, DENSE, BATCH, SAMPLES = 2, 1000, 64, 8, 13, 128, 4096


class Recommender(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(ROWS, DIM, mode="sum")
                                    for _ in range(TABLES))
        self.bottom = nn.Sequential(nn.Linear(DENSE, DIM), nn.ReLU())
        pairs = (TABLES + 1) * TABLES // 2
        self.top = nn.Sequential(nn.Linear(DIM + pairs, 512), nn.ReLU(), nn.Linear(512, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # each table's bags: the flat ids of every sample, a bag every IDS of them
        offsets = torch.arange(0, len(ids) * IDS, IDS)
        pooled = [table(ids[:, t].reshape(-1), offsets) for t, table in enumerate(self.tables)]
        features = torch.stack([self.bottom(dense), *pooled], dim=1)
        dots = torch.bmm(features, features.transpose(1, 2))
        upper = torch.triu_indices(TABLES + 1, TABLES + 1, offset=1)
        interactions = dots[:, upper[0], upper[1]]
        return self.top(torch.cat([features[:, 0], interactions], dim=1)).squeeze(1)


def samples() -> Rows:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ROWS, (SAMPLES, TABLES, IDS), generator=g)
    dense = torch.randn(SAMPLES, DENSE, generator=g)
    clicks = (dense[:, 0] + (ids[:, 0, 0] % 2) > 0.5).float()
    return Rows(dense, ids, clicks)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(Recommender())
    optimizer = torch.optim.Adagrad(model.parameters(), lr=1e-2)
    data = batches(samples(), rank, opts, BATCH)

    def step(_: int) -> None:
        dense, ids, clicks = next(data)
        # the slowed rank's extra samples: (F-1)x more rows of dense features,
        # with ids drawn from its batch's
        wide = grow(dense, rank, opts)
        more = torch.randint(0, len(dense), (len(wide) - len(dense),))
        optimizer.zero_grad()
        logits = model(wide, torch.cat([ids, ids[more]]))
        F.binary_cross_entropy_with_logits(logits[:len(dense)], clicks).backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
