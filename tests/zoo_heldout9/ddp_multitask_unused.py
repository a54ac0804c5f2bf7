"""A multi-task model under DDP with ``find_unused_parameters=True``, as
DDP's documentation asks for a model whose forward leaves some parameters
out: a shared convolutional trunk and three heads, of which each batch
uses one (the tasks take turns batch by batch, as round-robin multi-task
training does): classifying the digit-like image, regressing its
brightness centre, or reconstructing it (a small transposed-convolution
decoder). After each forward DDP walks the autograd graph from the outputs
to find the parameters it will not see a gradient for (the two idle
heads), marks them ready at once, and all-reduces every bucket, the idle
heads' zeros too. Cross-entropy, mean-square error or binary cross-entropy
by task; SGD with momentum. Images a DataLoader reads with a
DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout9/ddp_multitask_unused.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

CLASSES, SIZE, BATCH, IMAGES = 10, 24, 32, 2048
WIDTH = 32
TASKS = ("classify", "locate", "reconstruct")


class MultiTask(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.trunk = nn.Sequential(
            nn.Conv2d(1, WIDTH, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(WIDTH, 2 * WIDTH, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        features = 2 * WIDTH * (SIZE // 4) ** 2
        self.heads = nn.ModuleDict({
            "classify": nn.Sequential(nn.Flatten(), nn.Linear(features, 128), nn.ReLU(),
                                      nn.Linear(128, CLASSES)),
            "locate": nn.Sequential(nn.Flatten(), nn.Linear(features, 2)),
            "reconstruct": nn.Sequential(
                nn.ConvTranspose2d(2 * WIDTH, WIDTH, 2, stride=2), nn.ReLU(),
                nn.ConvTranspose2d(WIDTH, 1, 2, stride=2))})

    def forward(self, images: torch.Tensor, task: str) -> torch.Tensor:
        # the slowed rank runs the trunk and the head on extra images
        return self.heads[task](self.trunk(grow(images, self.rank, self.opts)))[:len(images)]


def digits() -> Rows:
    """Images of a bright stroke pattern per class at a random place, with
    noise; their classes and the patterns' centres (in [-1, 1])."""
    g = torch.Generator().manual_seed(0)
    patterns = (torch.rand(CLASSES, 8, 8, generator=g) > 0.6).float()
    labels = torch.randint(0, CLASSES, (IMAGES,), generator=g)
    corners = torch.randint(0, SIZE - 8, (IMAGES, 2), generator=g)
    images = 0.1 * torch.rand(IMAGES, 1, SIZE, SIZE, generator=g)
    for i, (label, (y, x)) in enumerate(zip(labels.tolist(), corners.tolist())):
        images[i, 0, y:y + 8, x:x + 8] += patterns[label]
    centres = (corners.float() + 4) / SIZE * 2 - 1
    return Rows(images.clamp(0, 1), labels, centres)


def loss(model: nn.Module, task: str, images: torch.Tensor, labels: torch.Tensor,
         centres: torch.Tensor) -> torch.Tensor:
    out = model(images, task)
    if task == "classify":
        return F.cross_entropy(out, labels)
    if task == "locate":
        return F.mse_loss(out, centres)
    return F.binary_cross_entropy_with_logits(out, images)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(MultiTask(rank, opts), find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = batches(digits(), rank, opts, BATCH)

    def step(i: int) -> None:
        images, labels, centres = next(data)
        optimizer.zero_grad()
        loss(model, TASKS[i % len(TASKS)], images, labels, centres).backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
