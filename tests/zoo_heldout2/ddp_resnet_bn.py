"""A small ResNet (a stem and a basic block: two 3x3 convolutions with
BatchNorm and a strided shortcut) on 32x32 colour images under DDP, as the
CIFAR-10 examples write it. BatchNorm's running statistics are buffers: DDP broadcasts rank 0's to
every rank before each forward (``broadcast_buffers``, its default; gloo
has no ``SyncBatchNorm``). SGD with Nesterov momentum and weight decay,
cross-entropy; images a DataLoader reads with a DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout2/ddp_resnet_bn.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

WIDTHS, BATCH, IMAGES, CLASSES = (16, 32), 16, 256, 10


class BasicBlock(nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False),
                                          nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, WIDTHS[0], 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(WIDTHS[0]), nn.ReLU())
        self.blocks = BasicBlock(WIDTHS[0], WIDTHS[1], 2)
        self.head = nn.Linear(WIDTHS[1], CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1)
        return self.head(torch.flatten(x, 1))


def images() -> Rows:
    g = torch.Generator().manual_seed(0)
    return Rows(torch.randn(IMAGES, 3, 32, 32, generator=g),
                torch.randint(0, CLASSES, (IMAGES,), generator=g))


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(ResNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                                weight_decay=5e-4)
    data = batches(images(), rank, opts, BATCH)

    def step(_: int) -> None:
        x, target = next(data)
        optimizer.zero_grad()
        F.cross_entropy(model(grow(x, rank, opts))[:len(x)], target).backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
