"""A denoising autoencoder whose gradients are averaged by a hand-written
ring all-reduce, as PyTorch's "Writing Distributed Applications" tutorial
writes one with point-to-point sends: every rank passes a buffer to its
right-hand neighbour and receives its left-hand neighbour's, adding what it
receives, world-1 times, so each rank ends with the sum of every rank's
gradients. The model is a fully connected encoder to a small code and a
mirrored decoder with a sigmoid output, after PyTorch's autoencoder
examples, trained with Adam on the binary cross-entropy between the
reconstruction of a noisy image and the clean one. Images a DataLoader
reads with a DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout5/ring_allreduce_autoencoder.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Rows, Step, batches, grow, main, receive, send

SIDE, HIDDEN, CODE, BATCH, IMAGES, NOISE = 16, 128, 16, 64, 2048, 0.3
PIXELS = SIDE * SIDE


class Autoencoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(PIXELS, HIDDEN), nn.ReLU(),
                                     nn.Linear(HIDDEN, CODE))
        self.decoder = nn.Sequential(nn.Linear(CODE, HIDDEN), nn.ReLU(),
                                     nn.Linear(HIDDEN, PIXELS), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


PARAMETERS = sum(p.numel() for p in Autoencoder().parameters())  # floats in one message


def ring_allreduce(total: torch.Tensor, opts: Options) -> None:
    """The tutorial's ring: ``total`` becomes the sum over every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    outgoing, incoming = total.clone(), torch.empty_like(total)
    for _ in range(world - 1):
        sent = send(outgoing, right)
        receive(incoming, left, opts)
        total += incoming
        sent.wait()
        outgoing, incoming = incoming, outgoing  # pass on what came in


def average_gradients(model: nn.Module, opts: Options) -> None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    ring_allreduce(flat, opts)
    flat /= dist.get_world_size()
    for grad, averaged in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(averaged.view_as(grad))


def images() -> Rows:
    """Flattened images of smooth random blobs, values in [0, 1]."""
    g = torch.Generator().manual_seed(0)
    coarse = torch.rand(IMAGES, 1, 4, 4, generator=g) ** 3
    pictures = F.interpolate(coarse, size=SIDE, mode="bilinear", align_corners=False)
    return Rows(pictures.flatten(1).clamp(0, 1))


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)  # every rank starts from the same parameters
    model = Autoencoder()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = batches(images(), rank, opts, BATCH)

    def step(_: int) -> None:
        (clean,) = next(data)
        noisy = (clean + NOISE * torch.randn_like(clean)).clamp(0, 1)
        optimizer.zero_grad()
        # the slowed rank reconstructs extra images
        reconstructed = model(grow(noisy, rank, opts))[:len(clean)]
        F.binary_cross_entropy(reconstructed, clean).backward()
        average_gradients(model, opts)
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
