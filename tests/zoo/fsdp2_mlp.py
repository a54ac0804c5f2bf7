"""FSDP2 on an MLP: ``fully_shard`` on each linear layer and on the model;
parameters are all-gathered before use and gradients reduce-scattered.

    python tests/zoo/fsdp2_mlp.py --out DIR [--slow-rank R --factor F]
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from launch import Options, Step, main, random_batch_training

HIDDEN, BATCH, LAYERS = 512, 512, 4


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU())
                            for _ in range(LAYERS)))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return random_batch_training(model, (BATCH, HIDDEN), rank, opts)


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0]))
