"""Knowledge distillation under DDP, as users write it after PyTorch's
knowledge-distillation tutorial: a larger convolutional teacher, frozen (in
eval mode, its parameters without gradients, run under ``no_grad``), and a
smaller convolutional student under DDP, trained on a weighted sum of the
cross-entropy against the labels and the KL divergence between the
teacher's and the student's temperature-softened outputs (scaled by the
temperature squared); SGD with momentum. The teacher is random here, as a
pretrained one would be loaded; it costs the same. Images a DataLoader reads
with a DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout5/ddp_distillation.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

CLASSES, SIZE, BATCH, IMAGES = 10, 32, 16, 1024
TEMPERATURE, SOFT_WEIGHT = 2.0, 0.75


def convnet(widths: tuple[int, ...]) -> nn.Sequential:
    """Convolutions with ReLU and max-pooling, then a linear classifier."""
    layers: list[nn.Module] = []
    for inputs, outputs in zip((3, *widths), widths):
        layers += [nn.Conv2d(inputs, outputs, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(widths[-1], CLASSES))


class Grown(nn.Module):
    """A network fed extra images on the slowed rank."""

    def __init__(self, net: nn.Module, rank: int, opts: Options) -> None:
        super().__init__()
        self.net, self.rank, self.opts = net, rank, opts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(grow(x, self.rank, self.opts))[:len(x)]


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor,
                      labels: torch.Tensor) -> torch.Tensor:
    soft = F.kl_div(F.log_softmax(student / TEMPERATURE, dim=1),
                    F.softmax(teacher / TEMPERATURE, dim=1), reduction="batchmean")
    hard = F.cross_entropy(student, labels)
    return SOFT_WEIGHT * TEMPERATURE ** 2 * soft + (1 - SOFT_WEIGHT) * hard


def pictures() -> Rows:
    """Colour images whose class sets their mean colour, with noise."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, CLASSES, (IMAGES,), generator=g)
    colours = torch.rand(CLASSES, 3, 1, 1, generator=g)
    return Rows(colours[labels] + 0.5 * torch.randn(IMAGES, 3, SIZE, SIZE, generator=g), labels)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    teacher = Grown(convnet((32, 64)), rank, opts).eval().requires_grad_(False)
    student = DistributedDataParallel(Grown(convnet((16,)), rank, opts))
    optimizer = torch.optim.SGD(student.parameters(), lr=0.05, momentum=0.9)
    data = batches(pictures(), rank, opts, BATCH)

    def step(_: int) -> None:
        images, labels = next(data)
        with torch.no_grad():
            targets = teacher(images)
        optimizer.zero_grad()
        distillation_loss(student(images), targets, labels).backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
