"""Domain decomposition with halo exchange on a ring: each rank owns a
horizontal slab of every image (a periodic domain, rank 0's upper
neighbour is the last rank); before each convolution it sends its top row
to the rank above and its bottom row to the rank below and receives theirs
(``isend`` / ``irecv``), and in backward the halo rows' gradients travel
back the same way. Gradients are averaged with ``all_reduce`` as the
"Writing Distributed Applications" tutorial does; SGD.

    PYTHONPATH=tests/zoo python tests/zoo_heldout/halo_ring.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import (Options, Rows, Step, average_gradients, batches, grow, main, receive,
                    send)

CHANNELS, ROWS, WIDTH, LAYERS, BATCH, IMAGES = 32, 32, 128, 4, 4, 64


def exchange(top: torch.Tensor, bottom: torch.Tensor,
             opts: Options) -> tuple[torch.Tensor, torch.Tensor]:
    """Send ``top`` up and ``bottom`` down the ring; what arrives from above
    (its bottom row) and from below (its top row)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    above, below = (rank - 1) % world, (rank + 1) % world
    sends = [send(top.contiguous(), above), send(bottom.contiguous(), below)]
    from_above = receive(torch.empty_like(bottom), above, opts)
    from_below = receive(torch.empty_like(top), below, opts)
    for work in sends:
        work.wait()
    return from_above, from_below


class Halo(torch.autograd.Function):
    """Pad a slab with its neighbours' edge rows; in backward, return the
    gradients of those rows to their owners."""

    @staticmethod
    def forward(ctx: Any, slab: torch.Tensor, opts: Options) -> torch.Tensor:
        ctx.opts = opts
        from_above, from_below = exchange(slab[:, :, :1], slab[:, :, -1:], opts)
        return torch.cat([from_above, slab, from_below], dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # the first row's gradient belongs to the rank above, the last one's below
        to_top, to_bottom = exchange(grad[:, :, :1], grad[:, :, -1:], ctx.opts)
        inner = grad[:, :, 1:-1].clone()
        inner[:, :, :1] += to_top
        inner[:, :, -1:] += to_bottom
        return inner, None


class SlabNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # no padding across rows: the halo is the padding
        self.convs = nn.ModuleList(nn.Conv2d(CHANNELS, CHANNELS, 3, padding=(0, 1))
                                   for _ in range(LAYERS))

    def forward(self, x: torch.Tensor, rank: int, opts: Options) -> torch.Tensor:
        for conv in self.convs:
            x = torch.tanh(conv(grow(Halo.apply(x, opts), rank, opts)))[:len(x)]
        return x


def slabs(rank: int) -> Rows:
    g = torch.Generator().manual_seed(0)
    images = torch.randn(IMAGES, CHANNELS, ROWS * 4, WIDTH, generator=g)
    return Rows(images[:, :, rank * ROWS:(rank + 1) * ROWS])


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = SlabNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    # every rank reads the same images (one replica), its own slab of each
    data = batches(slabs(rank), rank, opts, BATCH, replicas=1, replica=0)

    def step(_: int) -> None:
        (x,) = next(data)
        F.mse_loss(model(x, rank, opts), x).backward()
        average_gradients(model.parameters())
        optimizer.step()
        optimizer.zero_grad()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
