"""A small Vision Transformer under DDP with a cosine learning-rate
schedule, as users write it after the ViT paper and PyTorch's ViT examples:
the image cut into patches by a strided convolution, a learned class token
and learned positions, pre-norm ``nn.TransformerEncoder`` layers (one, to
keep the job small), the class token's output to a linear head;
cross-entropy with label smoothing, AdamW, the learning rate warmed up
linearly and then annealed along a cosine (``LambdaLR``), stepped every
iteration. Images a DataLoader reads with a DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout5/ddp_vit_cosine.py --out DIR
"""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

CLASSES, SIZE, PATCH, MODEL, HEADS, BATCH, IMAGES = 10, 32, 4, 64, 4, 16, 1024
WARMUP, TOTAL = 2, 50  # iterations of the schedule


class ViT(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        patches = (SIZE // PATCH) ** 2
        self.embed = nn.Conv2d(3, MODEL, PATCH, stride=PATCH)
        self.cls = nn.Parameter(torch.zeros(1, 1, MODEL))
        self.positions = nn.Parameter(0.02 * torch.randn(1, patches + 1, MODEL))
        layer = nn.TransformerEncoderLayer(MODEL, HEADS, 2 * MODEL, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(MODEL), nn.Linear(MODEL, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed rank classifies extra images
        tokens = self.embed(grow(x, self.rank, self.opts)).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(len(tokens), -1, -1), tokens], dim=1)
        y = self.encoder(tokens + self.positions)
        return self.head(self.norm(y[:, 0]))[:len(x)]


def warmup_cosine(iteration: int) -> float:
    """The learning rate's multiplier: a linear warmup, then half a cosine."""
    if iteration < WARMUP:
        return (iteration + 1) / WARMUP
    progress = min(1.0, (iteration - WARMUP) / (TOTAL - WARMUP))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def pictures() -> Rows:
    """Colour images of a bright square whose position is the class."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, CLASSES, (IMAGES,), generator=g)
    images = 0.2 * torch.randn(IMAGES, 3, SIZE, SIZE, generator=g)
    for i, label in enumerate(labels.tolist()):
        top, left = 3 * label, 3 * (CLASSES - 1 - label)
        images[i, :, top:top + 6, left:left + 6] += 1.0
    return Rows(images, labels)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(ViT(rank, opts))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05,
                                  fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
    data = batches(pictures(), rank, opts, BATCH)

    def step(_: int) -> None:
        images, labels = next(data)
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels, label_smoothing=0.1).backward()
        optimizer.step()
        schedule.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
