"""A hand-written 1F1B pipeline: one stage per rank, activations sent
forward and gradients back with ``isend`` / ``irecv``; after its warm-up
forwards each stage alternates one forward and one backward.

    python tests/zoo/pipeline_1f1b.py --out DIR [--slow-rank R --factor F]
        [--slow-link A B --delay-ms D]
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from launch import Options, Step, annotated, grow, main, receive, send

HIDDEN, MICROBATCH, MICROBATCHES, LAYERS = 512, 128, 8, 2


class Stage:
    """One pipeline stage's layers and the microbatches it has in flight."""

    def __init__(self, rank: int, opts: Options) -> None:
        torch.manual_seed(rank)
        self.rank, self.opts = rank, opts
        self.world = dist.get_world_size()
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
                                      for _ in range(LAYERS)))
        self.optimizer = torch.optim.SGD(self.layers.parameters(), lr=1e-3)
        self.in_flight: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.sends: list[dist.Work] = []

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1

    def forward(self) -> None:
        x = torch.randn(MICROBATCH, HIDDEN)
        if not self.first:
            x = receive(x, self.rank - 1, self.opts).requires_grad_()
        with annotated(self.opts, "forward"):
            y = self.layers(grow(x, self.rank, self.opts))[:MICROBATCH]
        if not self.last:
            self.sends.append(send(y.detach(), self.rank + 1))
        self.in_flight.append((x, y))

    def backward(self) -> None:
        x, y = self.in_flight.pop(0)
        if self.last:
            grad = torch.ones_like(y) / y.numel()
        else:
            grad = receive(torch.empty_like(y), self.rank + 1, self.opts)
        with annotated(self.opts, "backward"):
            y.backward(grad)
        if not self.first:
            assert x.grad is not None
            self.sends.append(send(x.grad, self.rank - 1))

    def iteration(self) -> None:
        warmup = min(self.world - self.rank - 1, MICROBATCHES)
        for _ in range(warmup):
            self.forward()
        for _ in range(MICROBATCHES - warmup):
            self.forward()
            self.backward()
        for _ in range(warmup):
            self.backward()
        for work in self.sends:
            work.wait()
        self.sends.clear()
        with annotated(self.opts, "optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad()


def build(rank: int, opts: Options) -> Step:
    stage = Stage(rank, opts)
    return lambda _: stage.iteration()


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0]))
