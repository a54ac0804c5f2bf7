"""DistributedDataParallel with gradient accumulation, gradient clipping
and bfloat16 autocast, as PyTorch's DDP and automatic mixed precision
documentation describe them: each optimizer step takes two micro-steps of
half a batch each, the first under ``model.no_sync()`` (its gradients
only accumulated locally), the second synchronising the accumulated
gradients by DDP's all-reduce. The forward runs under
``torch.autocast("cpu", dtype=torch.bfloat16)``, the loss and backward
outside it. The gradients are clipped to a norm of 1 and SGD with
momentum steps them, its learning rate set by a OneCycleLR schedule. The
model is a small residual MLP (an input projection, two pre-norm
residual blocks, a classifier); each rank reads its share of the samples.

    PYTHONPATH=tests/zoo python tests/zoo_heldout12/ddp_gradient_accumulation_clip_amp.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from launch import Options, Step, batches, grow, main
from job_parts import FeedForwardBlock, clustered_samples

FEATURES, CLASSES, WIDTH, BLOCKS = 64, 16, 256, 2
BATCH, SAMPLES = 256, 16384
MICRO_STEPS = 2


class ResidualMLP(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.inputs = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.Sequential(*(FeedForwardBlock(WIDTH, 2, F.relu) for _ in range(BLOCKS)))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed rank runs its layers on extra samples
        return self.head(self.blocks(self.inputs(grow(x, self.rank, self.opts))))[:len(x)]


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DDP(ResidualMLP(rank, opts))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10_000)
    data = batches(clustered_samples(CLASSES, SAMPLES, FEATURES), rank, opts, BATCH)

    def micro_step(features: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(features)
        (F.cross_entropy(logits.float(), labels) / MICRO_STEPS).backward()

    def step(_: int) -> None:
        features, labels = next(data)
        half = BATCH // MICRO_STEPS
        with model.no_sync():
            micro_step(features[:half], labels[:half])
        micro_step(features[half:], labels[half:])
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
