"""ZeRO stage 3 written by hand (Rajbhandari et al., "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", 2020), layer by
layer as FSDP and DeepSpeed run it: each rank keeps only a quarter of
every linear layer's parameters (the layer's weight and bias flattened
into one vector, padded to a multiple of the world, cut in four). In the
forward each layer all-gathers its quarters into the whole weight and
bias (``all_gather_single``) just before it runs and drops them after; in
the backward it all-gathers them again, computes its input's, weight's
and bias's gradients, and reduce-scatters the flat gradient
(``reduce_scatter_single``), so that each rank receives the sum over the
ranks for its own quarter only. The layer is an autograd function
written for this; Adam steps each rank's quarters with the averaged
gradients. The model is an MLP of four linear layers (GELU between
them) classifying feature vectors; each rank reads its share of the
samples (a DataLoader with a DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout13/manual_zero3_layerwise_allgather.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Step, batches, grow, main, train_step
from job_parts import clustered_samples

FEATURES, CLASSES, WIDTH, LAYERS = 64, 16, 384, 4
BATCH, SAMPLES = 128, 16384


def gathered(shard: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole weight (of ``shape``) and bias that the ranks' quarters make."""
    flat = torch.empty(shard.numel() * dist.get_world_size())
    dist.all_gather_single(flat, shard)
    rows, columns = shape
    return flat[:rows * columns].view(shape), flat[rows * columns:rows * columns + rows]


class GatheredLinear(torch.autograd.Function):
    """A linear layer of which this rank holds a quarter (``shard``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shard: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        ctx.save_for_backward(x, shard)
        ctx.shape = shape
        weight, bias = gathered(shard, shape)
        return F.linear(x, weight, bias)  # the whole weight is dropped here

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, None]:
        x, shard = ctx.saved_tensors
        weight, _ = gathered(shard, ctx.shape)  # gathered again
        flat = torch.zeros(shard.numel() * dist.get_world_size())
        rows, columns = ctx.shape
        flat[:rows * columns] = grad.t().mm(x).flatten()
        flat[rows * columns:rows * columns + rows] = grad.sum(0)
        shard_grad = torch.empty_like(shard)
        dist.reduce_scatter_single(shard_grad, flat)
        x_grad = grad.mm(weight) if ctx.needs_input_grad[0] else None
        return x_grad, shard_grad / dist.get_world_size(), None


class ShardedLinear(nn.Module):
    """This rank's quarter of ``full``'s flattened weight and bias."""

    def __init__(self, full: nn.Linear, rank: int, world: int) -> None:
        super().__init__()
        self.shape = full.weight.shape
        flat = torch.cat([full.weight.detach().flatten(), full.bias.detach()])
        quarter = -(-len(flat) // world)
        padded = torch.zeros(quarter * world)
        padded[:len(flat)] = flat
        self.shard = nn.Parameter(padded[rank * quarter:(rank + 1) * quarter].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return GatheredLinear.apply(x, self.shard, self.shape)


class MLP(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        widths = (FEATURES, *([WIDTH] * (LAYERS - 1)), CLASSES)
        world = dist.get_world_size()
        self.layers = nn.ModuleList(ShardedLinear(nn.Linear(a, b), rank, world)
                                    for a, b in zip(widths, widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed rank runs its layers on extra samples
        h = grow(x, self.rank, self.opts)
        for i, layer in enumerate(self.layers):
            h = layer(h) if i == len(self.layers) - 1 else F.gelu(layer(h))
        return h[:len(x)]


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)  # the same whole layers everywhere, each rank its quarters
    model = MLP(rank, opts)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = batches(clustered_samples(CLASSES, SAMPLES, FEATURES), rank, opts, BATCH)

    def step(_: int) -> None:
        features, labels = next(data)
        train_step(lambda: F.cross_entropy(model(features), labels), optimizer, opts)
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
