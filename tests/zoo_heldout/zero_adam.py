"""``ZeroRedundancyOptimizer`` as its recipe uses it: a DDP model whose
Adam state is sharded, each rank stepping its own share of the parameters
and broadcasting them to the others afterwards; a stack of linear layers
trained on feature vectors a DataLoader reads.

    PYTHONPATH=tests/zoo python tests/zoo_heldout/zero_adam.py --out DIR
"""
from __future__ import annotations

import sys

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

WIDTH, LAYERS, BATCH, SAMPLES = 512, 6, 128, 4096


def samples() -> Rows:
    g = torch.Generator().manual_seed(0)
    return Rows(torch.randn(SAMPLES, WIDTH, generator=g))


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    layers = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    model = DistributedDataParallel(layers)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                        lr=1e-3)
    data = batches(samples(), rank, opts, BATCH)

    def step(_: int) -> None:
        (x,) = next(data)
        model(grow(x, rank, opts))[:len(x)].square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
