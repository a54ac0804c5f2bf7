"""Data parallelism whose gradients are averaged by a hand-written
recursive-doubling (butterfly) all-reduce (Thakur, Rabenseifner and
Gropp, "Optimization of Collective Communication Operations in MPICH",
2005) with the blocking ``dist.send`` and ``dist.recv`` of PyTorch's
"Writing Distributed Applications" tutorial: every rank holds the same
MLP (an input layer, two hidden layers, a classifier, GELU between
them), and after the backward joins its gradients into one flat buffer.
In step k (k = 1, 2) each rank exchanges its whole buffer with the rank
whose number differs from its own in bit k-1 (step 1: ranks 0 and 1, 2
and 3; step 2: ranks 0 and 2, 1 and 3), the lower rank sending first and
the higher receiving first (so that two blocking calls never wait for
each other), and adds what it received to what it holds, the lower
rank's part first; after log2(4) = 2 steps every rank holds the sum of
the four ranks' gradients, bit for bit the same on each. The sum is
divided by the world size and copied back into the gradients; Adam.
Each rank reads its share of the samples (a DataLoader with a
DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout14/butterfly_allreduce_send_recv.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Step, batches, grow, main
from job_parts import clustered_samples, flat_gradients, unflatten_gradients

FEATURES, CLASSES, WIDTH, HIDDEN_LAYERS = 64, 16, 384, 2
BATCH, SAMPLES = 1024, 32768
WIDTHS = (FEATURES, *[WIDTH] * (HIDDEN_LAYERS + 1), CLASSES)
# floats in one message: every gradient of the MLP, flattened
MESSAGE = sum(a * b + b for a, b in zip(WIDTHS, WIDTHS[1:]))


class MLP(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(WIDTHS, WIDTHS[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed rank runs its layers on extra samples
        h = grow(x, self.rank, self.opts)
        for layer in self.layers[:-1]:
            h = F.gelu(layer(h))
        return self.layers[-1](h)[:len(x)]


def butterfly_all_reduce(flat: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's ``flat``, by recursive doubling."""
    rank, world = dist.get_rank(), dist.get_world_size()
    distance = 1
    while distance < world:
        partner = rank ^ distance
        received = torch.empty_like(flat)
        if rank < partner:
            dist.send(flat, partner)
            dist.recv(received, partner)
            flat = flat + received
        else:
            dist.recv(received, partner)
            dist.send(flat, partner)
            flat = received + flat
        distance *= 2
    return flat


def build(rank: int, opts: Options) -> Step:
    assert opts.world & (opts.world - 1) == 0  # recursive doubling: a power of two
    torch.manual_seed(0)  # every rank starts from the same parameters
    model = MLP(rank, opts)
    parameters = list(model.parameters())
    assert sum(p.numel() for p in parameters) == MESSAGE
    optimizer = torch.optim.Adam(parameters, lr=1e-3)
    data = batches(clustered_samples(CLASSES, SAMPLES, FEATURES), rank, opts, BATCH)

    def step(_: int) -> None:
        features, labels = next(data)
        optimizer.zero_grad()
        F.cross_entropy(model(features), labels).backward()
        summed = butterfly_all_reduce(flat_gradients(parameters))
        unflatten_gradients(summed / opts.world, parameters)
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
