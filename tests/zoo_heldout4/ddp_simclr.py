"""Contrastive self-supervised learning (SimCLR) under DDP, as users write
it after the SimCLR paper and its PyTorch ports: two random views of each
image (a shifted crop, a flip, brightness jitter, noise), a small
convolutional encoder and a projection head; every rank all-gathers the
normalised embeddings of both views each step so that the NT-Xent loss
contrasts each image against the whole global batch (the gathered copies
carry no gradient, the rank's own slice is its own embeddings), LARS
replaced by SGD with momentum as small ports do. Images a DataLoader reads
with a DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout4/ddp_simclr.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

SIZE, CROP, WIDTH, FEATURES, PROJECTION, BATCH, IMAGES = 28, 24, 32, 128, 64, 16, 1024
TEMPERATURE = 0.5


class SimCLR(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.encoder = nn.Sequential(
            nn.Conv2d(3, WIDTH, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(WIDTH, 2 * WIDTH, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * WIDTH, FEATURES))
        self.head = nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.ReLU(),
                                  nn.Linear(FEATURES, PROJECTION))

    def forward(self, views: torch.Tensor) -> torch.Tensor:
        # the slowed rank embeds extra views
        z = self.head(self.encoder(grow(views, self.rank, self.opts)))[:len(views)]
        return F.normalize(z, dim=1)


def augmented(images: torch.Tensor) -> torch.Tensor:
    """A random view of each image: a shifted crop, a flip, jitter, noise."""
    top, left = torch.randint(0, SIZE - CROP + 1, (2,)).tolist()
    view = images[:, :, top:top + CROP, left:left + CROP]
    flip = torch.rand(len(images), 1, 1, 1) < 0.5
    view = torch.where(flip, view.flip(3), view)
    view = view * torch.empty(len(images), 1, 1, 1).uniform_(0.6, 1.4)
    return view + 0.05 * torch.randn_like(view)


def gathered(z: torch.Tensor) -> torch.Tensor:
    """Every rank's embeddings, this rank's own (with their gradient) in place."""
    copies = [torch.empty_like(z) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, z.detach())
    copies[dist.get_rank()] = z
    return torch.cat(copies)


def nt_xent(z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
    """The normalised temperature-scaled cross-entropy of the paper: each
    view's positive is the other view of its image, its negatives every
    other embedding of the global batch."""
    z = torch.cat([gathered(z1), gathered(z2)])
    n = len(z) // 2
    logits = z @ z.t() / TEMPERATURE
    logits.fill_diagonal_(float("-inf"))
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(logits, targets)


def pictures() -> Rows:
    """Random colour images of blurred blobs (labels are not used)."""
    g = torch.Generator().manual_seed(0)
    coarse = torch.rand(IMAGES, 3, 4, 4, generator=g)
    return Rows(F.interpolate(coarse, size=SIZE, mode="bilinear", align_corners=False))


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(SimCLR(rank, opts))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.06, momentum=0.9, weight_decay=5e-4)
    data = batches(pictures(), rank, opts, BATCH)

    def step(_: int) -> None:
        (images,) = next(data)
        views = torch.cat([augmented(images), augmented(images)])
        optimizer.zero_grad()
        z1, z2 = model(views).chunk(2)
        nt_xent(z1, z2).backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
