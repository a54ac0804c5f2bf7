"""A tensor-parallel MLP pair as Megatron writes it: a column-parallel
linear (each rank a slice of the hidden units) then a row-parallel one,
whose partial outputs are all-reduced; in backward the input's gradient is
all-reduced. Every rank sees the same batch.

    python tests/zoo/tp_mlp.py --out DIR [--slow-rank R --factor F]
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from launch import Options, Step, grow, main, train_step

HIDDEN, BATCH, BLOCKS = 512, 512, 2


class AllReduceForward(torch.autograd.Function):
    """Sum partial outputs across ranks; the gradient passes through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class AllReduceBackward(torch.autograd.Function):
    """The input is replicated; its gradient is summed across ranks."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class ParallelMLP(nn.Module):
    def __init__(self, world: int) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN // world)  # column parallel
        self.down = nn.Linear(4 * HIDDEN // world, HIDDEN, bias=False)  # row parallel

    def forward(self, x: torch.Tensor, rank: int, opts: Options) -> torch.Tensor:
        x = AllReduceBackward.apply(x)
        partial = self.down(torch.relu(self.up(grow(x, rank, opts))))[:len(x)]
        return AllReduceForward.apply(partial)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(rank)
    blocks = nn.ModuleList(ParallelMLP(dist.get_world_size()) for _ in range(BLOCKS))
    optimizer = torch.optim.SGD(blocks.parameters(), lr=1e-3)

    def loss(i: int) -> torch.Tensor:
        x = torch.randn(BATCH, HIDDEN, generator=torch.Generator().manual_seed(i))
        for block in blocks:
            x = x + block(x, rank, opts)
        return x.square().mean()
    return lambda i: train_step(lambda: loss(i), optimizer, opts)


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0]))
