"""torch.distributed.pipelining's own 1F1B schedule: one stage per rank
(``PipelineStage``, ``Schedule1F1B``); the schedule does the point-to-point
itself (``batch_isend_irecv``), so this job has no slow-link option.

    python tests/zoo/pipelining_1f1b.py --out DIR [--slow-rank R --factor F]
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from launch import Options, Step, grow, main

HIDDEN, BATCH, MICROBATCHES, LAYERS = 512, 1024, 8, 2


class StageLayers(nn.Module):
    """A stage's layers; on the slowed rank its matmuls are bigger."""

    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
                                      for _ in range(LAYERS)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(grow(x, self.rank, self.opts))[:len(x)]


def mean_square(y: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
    return y.square().mean()


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(rank)
    world = dist.get_world_size()
    module = StageLayers(rank, opts)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=mean_square)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)

    def step(_: int) -> None:
        batch = torch.randn(BATCH, HIDDEN)
        if rank == 0:
            schedule.step(batch)
        elif rank == world - 1:
            schedule.step(target=batch)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0]))
