"""A VGG-style classifier under DDP whose gradients are compressed by
PowerSGD, as users set it up after PyTorch's DDP communication hooks
documentation and the PowerSGD paper: ``register_comm_hook`` with
``powerSGD_hook`` (rank-1 approximations, error feedback and warm start,
the first two iterations all-reduced uncompressed; one gradient bucket).
The tensors that would not shrink (biases) are all-reduced whole, then each
gradient matrix is all-reduced as two thin factors, P then Q, with an
orthogonalisation between them. The network follows the VGG paper and
torchvision's ``vgg``: stacks of 3x3 convolutions with ReLU and max-pools
(three stages, narrower than the paper's five, to keep the job small), then
three linear layers with dropout; cross-entropy, SGD with momentum and
weight decay (fused). Images a DataLoader reads with a DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout6/ddp_powersgd_vgg.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

CLASSES, SIZE, BATCH, IMAGES = 10, 32, 32, 1024
STAGES = ((16,), (32,), (64, 64))  # convolutions per stage, each stage ending in a max-pool
HIDDEN = 256


class VGG(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        layers: list[nn.Module] = []
        channels = 3
        for stage in STAGES:
            for width in stage:
                layers += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(inplace=True)]
                channels = width
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        side = SIZE // 2 ** len(STAGES)
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(channels * side * side, HIDDEN), nn.ReLU(inplace=True),
            nn.Dropout(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(HIDDEN, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed rank classifies extra images
        return self.classifier(self.features(grow(x, self.rank, self.opts)))[:len(x)]


def pictures() -> Rows:
    """Colour images of a bright diagonal band whose angle is the class."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, CLASSES, (IMAGES,), generator=g)
    axis = torch.linspace(-1, 1, SIZE)
    angles = labels.float().view(-1, 1, 1) * torch.pi / CLASSES
    distance = axis.view(1, 1, -1) * torch.cos(angles) + axis.view(1, -1, 1) * torch.sin(angles)
    band = (distance.abs() < 0.2).float().unsqueeze(1).expand(IMAGES, 3, SIZE, SIZE)
    return Rows(band + 0.4 * torch.randn(IMAGES, 3, SIZE, SIZE, generator=g), labels)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    # one gradient bucket: the hook chains its all-reduces in callbacks, which
    # gloo's threads would run in different orders on different ranks for two
    model = DistributedDataParallel(VGG(rank, opts), bucket_cap_mb=64)
    state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                   start_powerSGD_iter=2)
    model.register_comm_hook(state, powerSGD.powerSGD_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4,
                                fused=True)
    data = batches(pictures(), rank, opts, BATCH)

    def step(_: int) -> None:
        images, labels = next(data)
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
