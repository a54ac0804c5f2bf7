"""A convolutional net under DDP, as PyTorch's MNIST example writes it (two
convolutions, max-pool, dropout, two linear layers, log-softmax, NLL loss,
Adadelta), on 28x28 images a DataLoader reads with a DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout/ddp_convnet.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

BATCH, IMAGES = 16, 256


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def images() -> Rows:
    g = torch.Generator().manual_seed(0)
    return Rows(torch.randn(IMAGES, 1, 28, 28, generator=g),
                         torch.randint(0, 10, (IMAGES,), generator=g))


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(Net())
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    data = batches(images(), rank, opts, BATCH)

    def step(_: int) -> None:
        x, target = next(data)
        optimizer.zero_grad()
        output = model(grow(x, rank, opts))[:len(x)]
        F.nll_loss(output, target).backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
