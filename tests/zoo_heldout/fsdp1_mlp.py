"""FSDP1 (``FullyShardedDataParallel``) as its getting-started tutorial
wraps a model: a size-based auto-wrap policy puts each large block in a
unit of its own, whose parameters are all-gathered for forward and
backward and whose gradients are reduce-scattered; Adam on the shards; a
classifier of feature vectors a DataLoader reads.

    PYTHONPATH=tests/zoo python tests/zoo_heldout/fsdp1_mlp.py --out DIR
"""
from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

from launch import Options, Rows, Step, batches, grow, main

FEATURES, HIDDEN, BLOCKS, CLASSES, BATCH, SAMPLES = 256, 512, 2, 16, 128, 4096


def classifier() -> nn.Sequential:
    blocks = [nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
              for _ in range(BLOCKS)]
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), *blocks, nn.Linear(HIDDEN, CLASSES))


def samples() -> Rows:
    g = torch.Generator().manual_seed(0)
    return Rows(torch.randn(SAMPLES, FEATURES, generator=g),
                         torch.randint(0, CLASSES, (SAMPLES,), generator=g))


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=100_000)
    model = FullyShardedDataParallel(classifier(), auto_wrap_policy=policy,
                                     device_id=torch.device("cpu"))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = batches(samples(), rank, opts, BATCH)

    def step(_: int) -> None:
        x, target = next(data)
        optimizer.zero_grad()
        F.cross_entropy(model(grow(x, rank, opts))[:len(x)], target).backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
