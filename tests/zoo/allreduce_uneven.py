"""An all-reduce / all-gather loop with uneven work: each step every rank
runs a number of matmuls drawn afresh (as data-dependent work does, so the
last rank to arrive changes from step to step), then all-reduces a
gradient-sized buffer and all-gathers a small statistic.

    python tests/zoo/allreduce_uneven.py --out DIR [--slow-rank R --factor F]
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from launch import Options, Step, grow, main

HIDDEN, BATCH, FEWEST, MOST, BUFFER = 512, 256, 8, 16, 1 << 20


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    weight = torch.randn(HIDDEN, HIDDEN) / HIDDEN ** 0.5
    buffer = torch.zeros(BUFFER)
    draws = torch.Generator().manual_seed(1000 + rank)
    world = dist.get_world_size()

    def step(_: int) -> None:
        matmuls = int(torch.randint(FEWEST, MOST + 1, (1,), generator=draws))
        x = grow(torch.randn(BATCH, HIDDEN), rank, opts)
        for _ in range(matmuls):
            x = torch.tanh(x @ weight)
        buffer.fill_(float(x[:BATCH].mean()))
        dist.all_reduce(buffer)
        stats = [torch.empty(1) for _ in range(world)]
        dist.all_gather(stats, x[:1, 0].contiguous())
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0]))
