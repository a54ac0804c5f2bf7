"""A GPipe-style pipeline: one stage per rank, each step all microbatches'
forwards first (activations sent down the pipeline), then all their
backwards in reverse order (gradients sent back up), then each stage's own
Adam step. The first stage reads inputs from a DataLoader, the last one
the targets (the same sampler, so the same samples).

    PYTHONPATH=tests/zoo python tests/zoo_heldout/gpipe.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Rows, Step, batches, grow, main, receive, send

WIDTH, MICROBATCH, MICROBATCHES, SAMPLES = 512, 64, 4, 2048


def samples() -> Rows:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, WIDTH, generator=g)
    return Rows(x, x.roll(1, dims=1))


class GPipeStage:
    def __init__(self, rank: int, opts: Options) -> None:
        torch.manual_seed(rank)
        self.rank, self.opts, self.world = rank, opts, dist.get_world_size()
        self.layers = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                                    nn.Linear(2 * WIDTH, WIDTH), nn.LayerNorm(WIDTH))
        self.optimizer = torch.optim.Adam(self.layers.parameters(), lr=1e-3)
        reads = rank in (0, self.world - 1)
        self.data = batches(samples(), rank, opts, MICROBATCH, 1, 0) if reads else None

    def run(self) -> None:
        inputs, outputs = [], []
        for _ in range(MICROBATCHES):
            x, y = self.forward()
            inputs.append(x)
            outputs.append(y)
        sends = []
        for x, y in zip(reversed(inputs), reversed(outputs)):
            sends += self.backward(x, y)
        for work in sends:
            work.wait()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rank == 0:
            assert self.data is not None
            x = next(self.data)[0]
        else:
            x = receive(torch.empty(MICROBATCH, WIDTH), self.rank - 1, self.opts).requires_grad_()
        y = self.layers(grow(x, self.rank, self.opts))[:MICROBATCH]
        if self.rank == self.world - 1:
            assert self.data is not None
            y = F.mse_loss(y, next(self.data)[1]) / MICROBATCHES
        else:
            send(y.detach(), self.rank + 1).wait()
        return x, y

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> list[dist.Work]:
        if self.rank == self.world - 1:
            y.backward()
        else:
            y.backward(receive(torch.empty_like(y), self.rank + 1, self.opts))
        if self.rank == 0:
            return []
        assert x.grad is not None
        return [send(x.grad, self.rank - 1)]


def build(rank: int, opts: Options) -> Step:
    stage = GPipeStage(rank, opts)
    return lambda _: stage.run()


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
