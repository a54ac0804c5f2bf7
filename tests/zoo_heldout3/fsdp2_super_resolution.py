"""Single-image super-resolution under FSDP2, as PyTorch's
super_resolution example writes the network (four convolutions and a
sub-pixel ``pixel_shuffle`` that trades channels for a twice larger
image), trained with Adam on the mean-square error against the
high-resolution image; ``fully_shard`` on the network (its parameters
all-gathered before the forward and the backward, its gradients
reduce-scattered). Image pairs a DataLoader reads with a
DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout3/fsdp2_super_resolution.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from launch import Options, Rows, Step, batches, grow, main

UPSCALE, LOW, BATCH, IMAGES = 2, 24, 8, 512


class Net(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.conv1, self.conv2 = nn.Conv2d(1, 64, 5, 1, 2), nn.Conv2d(64, 64, 3, 1, 1)
        self.conv3 = nn.Conv2d(64, 32, 3, 1, 1)
        self.conv4 = nn.Conv2d(32, UPSCALE ** 2, 3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed rank upscales extra images
        y = F.relu(self.conv1(grow(x, self.rank, self.opts)))
        y = F.relu(self.conv3(F.relu(self.conv2(y))))
        return F.pixel_shuffle(self.conv4(y), UPSCALE)[:len(x)]


def image_pairs() -> Rows:
    """Smooth random luminance images and their downscaled copies."""
    g = torch.Generator().manual_seed(0)
    coarse = torch.rand(IMAGES, 1, 6, 6, generator=g)
    high = F.interpolate(coarse, size=LOW * UPSCALE, mode="bicubic", align_corners=False)
    return Rows(F.avg_pool2d(high, UPSCALE), high)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = Net(rank, opts)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = batches(image_pairs(), rank, opts, BATCH)

    def step(_: int) -> None:
        low, high = next(data)
        optimizer.zero_grad()
        F.mse_loss(model(low), high).backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
