"""Synchronised BatchNorm written by hand under DistributedDataParallel: a
small convolutional net whose BatchNorm layers normalise with the
statistics of the global batch (every rank's images), as
``torch.nn.SyncBatchNorm`` does on GPUs (it takes only GPU inputs) and as
the hand-written synchronised BatchNorms that users port (Zhang et al.,
"Context Encoding for Semantic Segmentation", 2018; the
"Synchronized-BatchNorm-PyTorch" package) do with sums: in the forward
each BatchNorm all-reduces its images' per-channel sums, sums of squares
and count (``all_reduce`` of one buffer) and normalises with the global
mean and variance; in the backward, an autograd function written for this,
it all-reduces the per-channel sums of the output's gradient and of that
gradient times the normalised input, from which each rank computes its
input's gradient (the weight's and the bias's gradients are the rank's own
sums, averaged by DDP with the others). The running statistics, updated
from the global ones, are the same on every rank, so DDP broadcasts no
buffers (``broadcast_buffers=False``). The net: three 3x3 convolutions
(32, 64 and 64 channels, the last two strided), each followed by the
synchronised BatchNorm and ReLU, global average pooling and a linear
classifier (cross-entropy); SGD with Nesterov momentum and weight decay.
The images are 16x16 three-channel tensors around one of four centres per
class; each rank reads its share of them (a DataLoader with a
DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout16/ddp_sync_batchnorm_by_hand.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main, train_step
from job_parts import clustered_samples

CHANNELS, SIDE, WIDTHS, CLASSES = 3, 16, (32, 64, 64), 10
BATCH, IMAGES, EPS, MOMENTUM = 64, 8192, 1e-5, 0.1
DIMS = (0, 2, 3)  # a channel's statistics are over the images and their pixels


class SyncBatchNormFunction(torch.autograd.Function):
    """BatchNorm over every rank's batch: two all-reduces, one each way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                norm: SyncBatchNorm2d) -> torch.Tensor:
        channels = x.shape[1]
        count = torch.tensor([x.numel() / channels], dtype=x.dtype)
        stats = torch.cat([x.sum(DIMS), x.square().sum(DIMS), count])
        dist.all_reduce(stats)
        total = stats[-1]
        mean = stats[:channels] / total
        var = (stats[channels:2 * channels] / total - mean.square()).clamp_min(0.0)
        invstd = (var + EPS).rsqrt()
        norm.update_running(mean, var * total / (total - 1))
        shape = (1, channels, 1, 1)
        xhat = (x - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, weight, invstd, total)
        return xhat * weight.view(shape) + bias.view(shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        xhat, weight, invstd, total = ctx.saved_tensors
        channels = dy.shape[1]
        own = torch.cat([dy.sum(DIMS), (dy * xhat).sum(DIMS)])
        summed = own.clone()
        dist.all_reduce(summed)
        shape = (1, channels, 1, 1)
        mean_dy = (summed[:channels] / total).view(shape)
        mean_dy_xhat = (summed[channels:] / total).view(shape)
        dx = (dy - mean_dy - xhat * mean_dy_xhat) * (invstd * weight).view(shape)
        return dx, own[channels:], own[:channels], None


class SyncBatchNorm2d(nn.Module):
    running_mean: torch.Tensor
    running_var: torch.Tensor

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    @torch.no_grad()
    def update_running(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        self.running_mean.lerp_(mean, MOMENTUM)
        self.running_var.lerp_(unbiased_var, MOMENTUM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SyncBatchNormFunction.apply(x, self.weight, self.bias, self)


class ConvNet(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        widths = (CHANNELS, *WIDTHS)
        self.convs = nn.ModuleList(
            nn.Conv2d(a, b, 3, stride=1 if i == 0 else 2, padding=1, bias=False)
            for i, (a, b) in enumerate(zip(widths, widths[1:])))
        self.norms = nn.ModuleList(SyncBatchNorm2d(b) for b in WIDTHS)
        self.head = nn.Linear(WIDTHS[-1], CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, norm in zip(self.convs, self.norms):
            # the slowed rank convolves extra images, dropped before the
            # BatchNorm (whose global statistics they would change)
            x = F.relu(norm(conv(grow(x, self.rank, self.opts))[:len(x)]))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def images() -> Rows:
    features, labels = clustered_samples(CLASSES, IMAGES, CHANNELS * SIDE * SIDE).tensors
    return Rows(features.view(IMAGES, CHANNELS, SIDE, SIDE), labels)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(ConvNet(rank, opts), broadcast_buffers=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                                weight_decay=5e-4)
    data = batches(images(), rank, opts, BATCH)

    def step(_: int) -> None:
        x, labels = next(data)
        train_step(lambda: F.cross_entropy(model(x), labels), optimizer, opts)
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
