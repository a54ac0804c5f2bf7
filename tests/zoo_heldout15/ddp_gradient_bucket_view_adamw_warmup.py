"""A 1-D convolutional time-series classifier under DistributedDataParallel
with ``gradient_as_bucket_view=True`` and small gradient buckets, trained
with AdamW under a linear learning-rate warm-up, as PyTorch's DDP
documentation describes the option (each parameter's ``.grad`` a view
into DDP's all-reduce buckets, so the gradients are not copied into and
out of the buckets) and as Transformer-era recipes warm their optimizer up
(``LambdaLR`` whose factor rises linearly from 1/10 to 1 over the first
ten steps). The network is the fully convolutional baseline of Wang, Yan
and Oates ("Time Series Classification from Scratch with Deep Neural
Networks: A Strong Baseline", 2017), narrower: three 1-d convolutions
(kernels 7, 5 and 3, 64, 128 and 64 channels), each followed by a
normalisation and ReLU, global average pooling over time and a linear
classifier (cross-entropy); GroupNorm stands for the paper's BatchNorm
(a sample's statistics its own, so DDP has no buffers to broadcast). Each
sample is a series of 32 steps of 8 channels. ``bucket_cap_mb`` is 0.1,
so DDP all-reduces the gradients (71 k floats) in four buckets of at
most about 100 kB as the backward produces them (one parameter larger
than that, the second convolution's weight, in a bucket of its own). Each rank reads its share of the samples (a
DataLoader with a DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout15/ddp_gradient_bucket_view_adamw_warmup.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Step, batches, grow, main, train_step
from job_parts import clustered_samples

CHANNELS, LENGTH, CLASSES, GROUPS = 8, 32, 16, 8
BLOCKS = ((CHANNELS, 64, 7), (64, 128, 5), (128, 64, 3))  # in, out, kernel
BATCH, SAMPLES, BUCKET_MB, WARMUP = 128, 16384, 0.1, 10


def block(inputs: int, outputs: int, kernel: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv1d(inputs, outputs, kernel, padding=kernel // 2),
                         nn.GroupNorm(GROUPS, outputs), nn.ReLU())


class Classifier(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.blocks = nn.Sequential(*(block(*b) for b in BLOCKS))
        self.head = nn.Linear(BLOCKS[-1][1], CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed rank runs its convolutions on extra series
        series = grow(x.view(len(x), CHANNELS, LENGTH), self.rank, self.opts)
        return self.head(self.blocks(series).mean(dim=2)[:len(x)])


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(Classifier(rank, opts), gradient_as_bucket_view=True,
                                    bucket_cap_mb=BUCKET_MB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    warmup = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / WARMUP))
    data = batches(clustered_samples(CLASSES, SAMPLES, CHANNELS * LENGTH), rank, opts, BATCH)

    def step(_: int) -> None:
        features, labels = next(data)
        train_step(lambda: F.cross_entropy(model(features), labels), optimizer, opts)
        warmup.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
