"""A DCGAN under DDP, as PyTorch's dcgan example trains it: a generator of
transposed convolutions with BatchNorm (noise to 16x16 colour images) and
a discriminator of strided convolutions, each its own DDP model and its own
Adam (betas 0.5, 0.999); each step updates the discriminator on a real and
a generated batch (binary cross-entropy), then the generator through the
discriminator's verdict on its images. Real images a DataLoader reads with
a DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout3/ddp_dcgan.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

NOISE, WIDTH, SIZE, BATCH, IMAGES = 64, 64, 16, 32, 1024


def generator() -> nn.Module:
    return nn.Sequential(
        nn.ConvTranspose2d(NOISE, 2 * WIDTH, 4, 1, 0, bias=False), nn.BatchNorm2d(2 * WIDTH),
        nn.ReLU(True),  # 4x4
        nn.ConvTranspose2d(2 * WIDTH, WIDTH, 4, 2, 1, bias=False), nn.BatchNorm2d(WIDTH),
        nn.ReLU(True),  # 8x8
        nn.ConvTranspose2d(WIDTH, 3, 4, 2, 1, bias=False), nn.Tanh())  # 16x16


def discriminator() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, WIDTH, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, True),  # 8x8
        nn.Conv2d(WIDTH, 2 * WIDTH, 4, 2, 1, bias=False), nn.BatchNorm2d(2 * WIDTH),
        nn.LeakyReLU(0.2, True),  # 4x4
        nn.Conv2d(2 * WIDTH, 1, 4, 1, 0, bias=False), nn.Sigmoid(), nn.Flatten(0))


def images() -> Rows:
    """Smooth random colour images in [-1, 1] (what the generator outputs)."""
    g = torch.Generator().manual_seed(0)
    coarse = torch.rand(IMAGES, 3, 4, 4, generator=g) * 2 - 1
    return Rows(F.interpolate(coarse, size=SIZE, mode="bilinear"))


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    net_g, net_d = DistributedDataParallel(generator()), DistributedDataParallel(discriminator())
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-4, betas=(0.5, 0.999))
    data = batches(images(), rank, opts, BATCH)
    real_label, fake_label = torch.ones(BATCH), torch.zeros(BATCH)

    def step(_: int) -> None:
        (real,) = next(data)
        # the slowed rank generates and judges extra images (no loss on them)
        fake = net_g(grow(torch.randn(BATCH, NOISE, 1, 1), rank, opts))
        net_d.zero_grad()
        F.binary_cross_entropy(net_d(grow(real, rank, opts))[:BATCH], real_label).backward()
        F.binary_cross_entropy(net_d(fake.detach())[:BATCH], fake_label).backward()
        opt_d.step()
        net_g.zero_grad()
        F.binary_cross_entropy(net_d(fake)[:BATCH], real_label).backward()
        opt_g.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
