"""DDP on an MLP: each rank trains the same model on its own batch and
DistributedDataParallel all-reduces the gradients during backward.

    python tests/zoo/ddp_mlp.py --out DIR [--annotate] [--slow-rank R --factor F]
"""
from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Step, main, random_batch_training

HIDDEN, BATCH, LAYERS = 512, 256, 4


def mlp() -> nn.Sequential:
    torch.manual_seed(0)  # every rank starts from the same weights
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(HIDDEN, HIDDEN), nn.ReLU()]
    return nn.Sequential(*layers)


def build(rank: int, opts: Options) -> Step:
    model = DistributedDataParallel(mlp())
    return random_batch_training(model, (BATCH, HIDDEN), rank, opts)


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0]))
