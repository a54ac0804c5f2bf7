"""Data parallelism whose gradients are averaged by a two-level
(hierarchical) all-reduce, as Horovod's hierarchical all-reduce and
NCCL's two-level algorithms average over nodes of several devices
(Jia et al., "Highly Scalable Deep Learning Training System with
Mixed-Precision", 2018): the four ranks are two pairs, ranks 0 and 1, 2
and 3 (as two nodes of two), each pair a process group of its own, and
the pairs' leaders, ranks 0 and 2, meet point to point. Every rank holds
the same MLP classifier (an input layer, two pre-norm residual
feed-forward blocks, LayerNorm, a linear layer twice wider, SiLU, a linear
layer back, a final LayerNorm and a classifier) and after the backward
joins its gradients into one flat buffer. Level one: ``all_reduce``
within each pair. Level two: the leaders swap their pairs' sums with the
blocking ``dist.send`` and ``dist.recv`` of PyTorch's "Writing
Distributed Applications" tutorial (rank 0 sends first, rank 2 receives
first) and each adds pair 0's sum first, so both hold the same total bit
for bit. Then each leader ``broadcast``-s the total within its pair. The
sum is divided by the world size and copied back into the gradients;
Adam. Each rank reads its share of the samples (a DataLoader with a
DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout15/hierarchical_allreduce_two_level.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Step, batches, grow, main
from job_parts import FeedForwardBlock, clustered_samples, flat_gradients, unflatten_gradients

FEATURES, CLASSES, WIDTH, BLOCKS = 64, 16, 192, 2
BATCH, SAMPLES, PAIR = 512, 32768, 2
# floats in one message between the leaders: every gradient of the model, flattened
MESSAGE = (FEATURES * WIDTH + WIDTH + BLOCKS * (2 * WIDTH + 2 * WIDTH * 2 * WIDTH + 3 * WIDTH)
           + 2 * WIDTH + WIDTH * CLASSES + CLASSES)


class Classifier(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.inputs = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.Sequential(*(FeedForwardBlock(WIDTH, 2, F.silu)
                                      for _ in range(BLOCKS)))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed rank runs its layers on extra samples
        h = self.blocks(self.inputs(grow(x, self.rank, self.opts)))
        return self.head(self.norm(h[:len(x)]))


def build(rank: int, opts: Options) -> Step:
    world = dist.get_world_size()
    assert world % PAIR == 0
    # every rank creates every group, in the same order
    pairs = [dist.new_group(list(range(p, p + PAIR))) for p in range(0, world, PAIR)]
    pair, leader = pairs[rank // PAIR], rank - rank % PAIR
    leaders = list(range(0, world, PAIR))
    assert len(leaders) == 2  # the leaders swap their sums: two pairs
    torch.manual_seed(0)  # every rank starts from the same parameters
    model = Classifier(rank, opts)
    parameters = list(model.parameters())
    assert sum(p.numel() for p in parameters) == MESSAGE
    optimizer = torch.optim.Adam(parameters, lr=1e-3)
    data = batches(clustered_samples(CLASSES, SAMPLES, FEATURES), rank, opts, BATCH)

    def two_level_all_reduce(flat: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(flat, group=pair)  # level one: within the pair
        if rank == leader:  # level two: between the leaders
            other = torch.empty_like(flat)
            if rank == leaders[0]:
                dist.send(flat, leaders[1])
                dist.recv(other, leaders[1])
                flat = flat + other
            else:
                dist.recv(other, leaders[0])
                dist.send(flat, leaders[0])
                flat = other + flat
        dist.broadcast(flat, src=leader, group=pair)
        return flat

    def step(_: int) -> None:
        features, labels = next(data)
        optimizer.zero_grad()
        F.cross_entropy(model(features), labels).backward()
        summed = two_level_all_reduce(flat_gradients(parameters))
        unflatten_gradients(summed / world, parameters)
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
