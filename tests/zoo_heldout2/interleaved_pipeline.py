"""An interleaved pipeline with ``torch.distributed.pipelining``: eight
stages on four ranks, each rank holding two that are four stages apart
(stage s on rank s % 4), run by ``ScheduleInterleaved1F1B`` over four
microbatches. Activations go round the ranks in a ring (rank 3's first
stage feeds rank 0's second) and gradients back the other way; the
schedule does the point-to-point itself (``batch_isend_irecv``). Each rank
steps Adam over both of its stages.

    PYTHONPATH=tests/zoo python tests/zoo_heldout2/interleaved_pipeline.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

from launch import Options, Step, grow, main

WIDTH, BATCH, MICROBATCHES, CHUNKS = 512, 256, 4, 2


class StageLayers(nn.Module):
    """One stage's layers; on the slowed rank its matmuls are bigger."""

    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.layers = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(grow(x, self.rank, self.opts))[:len(x)]


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(rank)
    world = dist.get_world_size()
    modules = [StageLayers(rank, opts) for _ in range(CHUNKS)]
    # stage rank + 4 * chunk of eight (list[Any]: the schedule's list is of a private base class)
    stages: list[Any] = [PipelineStage(module, rank + chunk * world, CHUNKS * world,
                                       torch.device("cpu")) for chunk, module in enumerate(modules)]
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=MICROBATCHES, loss_fn=F.mse_loss)
    optimizer = torch.optim.Adam([p for m in modules for p in m.parameters()], lr=1e-3)
    g = torch.Generator().manual_seed(0)  # the first and last ranks draw the same samples

    def step(_: int) -> None:
        x = torch.randn(BATCH, WIDTH, generator=g)
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=torch.tanh(x))
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0]))
