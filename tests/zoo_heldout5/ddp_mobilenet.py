"""A MobileNet-style classifier under DDP, as users write it after the
MobileNet paper and torchvision's ``mobilenet_v2``: a stem convolution, then
depthwise-separable blocks (a 3x3 depthwise convolution, one filter per
channel, and a 1x1 pointwise convolution that mixes the channels, each
followed by BatchNorm and ReLU6; two blocks, the second with stride 2, to
keep the job small), global average pooling and a linear classifier;
cross-entropy, SGD with momentum and weight decay. Images a DataLoader reads
with a DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout5/ddp_mobilenet.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

CLASSES, SIZE, WIDTH, BATCH, IMAGES = 10, 32, 32, 16, 1024


def separable(inputs: int, outputs: int, stride: int) -> nn.Module:
    """A depthwise 3x3 convolution, then a pointwise 1x1 one."""
    return nn.Sequential(
        nn.Conv2d(inputs, inputs, 3, stride, 1, groups=inputs, bias=False),
        nn.BatchNorm2d(inputs), nn.ReLU6(inplace=True),
        nn.Conv2d(inputs, outputs, 1, bias=False), nn.BatchNorm2d(outputs),
        nn.ReLU6(inplace=True))


class MobileNet(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.features = nn.Sequential(
            nn.Conv2d(3, WIDTH, 3, 2, 1, bias=False), nn.BatchNorm2d(WIDTH),
            nn.ReLU6(inplace=True),
            separable(WIDTH, 2 * WIDTH, 1), separable(2 * WIDTH, 4 * WIDTH, 2),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(4 * WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed rank classifies extra images
        return self.classifier(self.features(grow(x, self.rank, self.opts)))[:len(x)]


def pictures() -> Rows:
    """Colour images whose class sets the frequency of a stripe pattern."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, CLASSES, (IMAGES,), generator=g)
    axis = torch.linspace(0, 1, SIZE)
    stripes = torch.sin(axis.view(1, 1, 1, -1) * (labels.view(-1, 1, 1, 1) + 1) * 3.14)
    images = stripes.expand(IMAGES, 3, SIZE, SIZE)
    return Rows(images + 0.3 * torch.randn(IMAGES, 3, SIZE, SIZE, generator=g), labels)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(MobileNet(rank, opts))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=4e-5)
    data = batches(pictures(), rank, opts, BATCH)

    def step(_: int) -> None:
        images, labels = next(data)
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
