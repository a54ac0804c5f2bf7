"""Hybrid sharding (HSDP) with activation checkpointing, as PyTorch's FSDP2
documentation and its large-model recipes combine them: ``fully_shard``
over a two-dimensional ``DeviceMesh`` (two replicas of two shards: ranks
0-1 and 2-3 each hold one copy of the parameters, half on each rank), so
a unit's parameters are all-gathered within its pair before use and its
gradients reduce-scattered within the pair, then all-reduced across the
replicas. The block is an FSDP unit of its own (the rest of the model is
the root unit) and is checkpointed (``torch.utils.checkpoint``, the
reentrant variant many training scripts use): its forward runs without
keeping activations and is run again in backward, after its parameters
are all-gathered again. The network follows ConvNeXt: a patchifying stem
(a 2x2 convolution, stride 2, and LayerNorm), a ConvNeXt block (a 7x7
depthwise convolution, LayerNorm over the channels, a pointwise MLP four
times wider with GELU, a learned per-channel scale, the residual; one
block, not the paper's four stages of them, to keep the job small),
global average pooling, LayerNorm and a linear classifier; cross-entropy
with label smoothing, AdamW (fused). Images a DataLoader reads with a
DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout7/hsdp_checkpointed_convnext.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

from launch import Options, Rows, Step, batches, grow, main

CLASSES, SIZE, BATCH, IMAGES = 10, 32, 8, 1024
WIDTH = 64
REPLICAS = 2  # the mesh: replicas x shards


class ChannelsNorm(nn.LayerNorm):
    """LayerNorm over the channels of a (batch, channels, height, width) map."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(width, width, 7, padding=3, groups=width)
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))
        self.scale = nn.Parameter(1e-6 * torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.depthwise(x).permute(0, 2, 3, 1))  # channels last
        return x + (self.scale * self.mlp(y)).permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.stem = nn.Sequential(nn.Conv2d(3, WIDTH, 2, stride=2), ChannelsNorm(WIDTH))
        self.block = ConvNeXtBlock(WIDTH)
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # the slowed rank classifies extra images
        x = self.stem(grow(images, self.rank, self.opts))
        # reentrant: the recomputation need not repeat the forward's calls one
        # for one (a rank calling its matmuls twice does so in forward only)
        x = checkpoint(self.block, x, use_reentrant=True)
        return self.head(self.norm(x.mean((2, 3))))[:len(images)]


def pictures() -> Rows:
    """Colour images of a few soft blobs, each class its own colour mix and
    number of blobs, with noise."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, CLASSES, (IMAGES,), generator=g)
    colours = torch.rand(CLASSES, 3, 1, 1, generator=g)
    axis = torch.linspace(-1, 1, SIZE)
    images = 0.3 * torch.randn(IMAGES, 3, SIZE, SIZE, generator=g)
    for i, label in enumerate(labels.tolist()):
        for _ in range(1 + label % 3):
            cx, cy = (torch.rand(2, generator=g) * 1.6 - 0.8).tolist()
            blob = torch.exp(-((axis.view(1, -1) - cx) ** 2 + (axis.view(-1, 1) - cy) ** 2) / 0.05)
            images[i] += colours[label] * blob
    return Rows(images, labels)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = ConvNeXt(rank, opts)
    mesh = init_device_mesh("cpu", (REPLICAS, dist.get_world_size() // REPLICAS),
                            mesh_dim_names=("replicate", "shard"))
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05, fused=True)
    data = batches(pictures(), rank, opts, BATCH)

    def step(_: int) -> None:
        images, labels = next(data)
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels, label_smoothing=0.1).backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
