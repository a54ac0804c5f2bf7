"""A U-Net for semantic segmentation under DDP, as users write it after the
U-Net paper and PyTorch's segmentation tutorials: an encoder of double
convolutions (each with a ReLU, as the paper has them) and max-pools, two
levels (not the paper's five, to keep the job small), a decoder of
transposed convolutions whose outputs are joined to the encoder's feature
maps of the same size (skip connections) and a 1x1 convolution to
per-pixel class scores; cross-entropy over every pixel, SGD with the paper's
high momentum. Images and their masks a DataLoader reads with a
DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout4/ddp_unet.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

CLASSES, SIZE, WIDTH, BATCH, IMAGES = 3, 32, 16, 8, 512


def double_conv(inputs: int, outputs: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(inputs, outputs, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(outputs, outputs, 3, padding=1), nn.ReLU(inplace=True))


class Up(nn.Module):
    """Upsample by a transposed convolution, join the skip, convolve."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(inputs, outputs, 2, stride=2)
        self.conv = double_conv(2 * outputs, outputs)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class UNet(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        w = WIDTH
        self.down = nn.ModuleList([double_conv(1, w), double_conv(w, 2 * w)])
        self.up = nn.ModuleList([Up(2 * w, w)])
        self.head = nn.Conv2d(w, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed rank segments extra images
        y, skips = grow(x, self.rank, self.opts), []
        for i, block in enumerate(self.down):
            y = block(F.max_pool2d(y, 2) if i else y)
            skips.append(y)
        for up, skip in zip(self.up, reversed(skips[:-1])):
            y = up(y, skip)
        return self.head(y)[:len(x)]


def scenes() -> Rows:
    """Noisy images of a bright disc and a dark square on grey; the mask
    says which pixel is background (0), disc (1) or square (2)."""
    g = torch.Generator().manual_seed(0)
    axis = torch.arange(SIZE).float()
    rows, cols = axis.view(1, -1, 1), axis.view(1, 1, -1)
    cy, cx, r = (torch.randint(8, SIZE - 8, (IMAGES, 1, 1), generator=g) for _ in range(3))
    sy, sx = (torch.randint(0, SIZE - 8, (IMAGES, 1, 1), generator=g) for _ in range(2))
    disc = (rows - cy) ** 2 + (cols - cx) ** 2 < (r % 6 + 3) ** 2
    square = (rows >= sy) & (rows < sy + 8) & (cols >= sx) & (cols < sx + 8)
    masks = torch.where(square, 2, torch.where(disc, 1, 0))
    images = 0.5 + 0.4 * disc.float() - 0.4 * square.float()
    images = images + 0.1 * torch.randn(IMAGES, SIZE, SIZE, generator=g)
    return Rows(images.unsqueeze(1), masks)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(UNet(rank, opts))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.99)  # the paper's
    data = batches(scenes(), rank, opts, BATCH)

    def step(_: int) -> None:
        images, masks = next(data)
        optimizer.zero_grad()
        F.cross_entropy(model(images), masks).backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
