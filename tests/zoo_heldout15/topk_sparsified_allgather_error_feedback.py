"""Data parallelism with sparsified gradients and error feedback, written
by hand after the papers that exchange only the largest entries (Aji and
Heafield, "Sparse Communication for Distributed Gradient Descent", 2017;
Lin et al., "Deep Gradient Compression", 2018; Stich et al., "Sparsified
SGD with Memory", 2018) with the ``all_gather`` of PyTorch's collective
communication: every rank holds the same MLP (an input layer, two hidden
layers, a classifier, ReLU between them) and after the backward joins its
gradients into one flat buffer and adds what it left out before (its
residual, the error feedback). It keeps the 1/16 of the entries largest
in magnitude (``torch.topk``) and leaves the rest in its residual for the
next step; the kept values and their indices (int64) are all-gathered
(two ``all_gather`` calls, every rank's k entries), and each rank adds
every rank's entries into a dense buffer in rank order (``index_add_``),
so that all four hold the same sum bit for bit. The sum is divided by the
world size and copied back into the gradients; SGD with momentum. Each
rank reads its share of the samples (a DataLoader with a
DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout15/topk_sparsified_allgather_error_feedback.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Step, batches, grow, main
from job_parts import clustered_samples, flat_gradients, unflatten_gradients

FEATURES, CLASSES, WIDTH, HIDDEN_LAYERS = 64, 16, 256, 2
BATCH, SAMPLES, KEPT = 512, 32768, 16  # KEPT: one entry in 16 is sent
WIDTHS = (FEATURES, *[WIDTH] * (HIDDEN_LAYERS + 1), CLASSES)


class MLP(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(WIDTHS, WIDTHS[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed rank runs its layers on extra samples
        h = grow(x, self.rank, self.opts)
        for layer in self.layers[:-1]:
            h = F.relu(layer(h))
        return self.layers[-1](h)[:len(x)]


class Sparsifier:
    """Top-k of the gradient plus the residual; the rest is the new residual."""

    def __init__(self, size: int) -> None:
        self.residual = torch.zeros(size)
        self.k = size // KEPT

    def __call__(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        accumulated = self.residual + flat
        indices = accumulated.abs().topk(self.k, sorted=False).indices
        values = accumulated[indices]
        accumulated[indices] = 0.0
        self.residual = accumulated
        return values, indices


def sparse_all_reduce(values: torch.Tensor, indices: torch.Tensor, size: int) -> torch.Tensor:
    """The dense sum of every rank's (values, indices), added in rank order."""
    world = dist.get_world_size()
    all_values = [torch.empty_like(values) for _ in range(world)]
    all_indices = [torch.empty_like(indices) for _ in range(world)]
    dist.all_gather(all_values, values)
    dist.all_gather(all_indices, indices)
    dense = torch.zeros(size)
    for v, i in zip(all_values, all_indices):
        dense.index_add_(0, i, v)
    return dense


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)  # every rank starts from the same parameters
    model = MLP(rank, opts)
    parameters = list(model.parameters())
    size = sum(p.numel() for p in parameters)
    sparsify = Sparsifier(size)
    optimizer = torch.optim.SGD(parameters, lr=0.05, momentum=0.9)
    data = batches(clustered_samples(CLASSES, SAMPLES, FEATURES), rank, opts, BATCH)

    def step(_: int) -> None:
        features, labels = next(data)
        optimizer.zero_grad()
        F.cross_entropy(model(features), labels).backward()
        summed = sparse_all_reduce(*sparsify(flat_gradients(parameters)), size)
        unflatten_gradients(summed / opts.world, parameters)
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
