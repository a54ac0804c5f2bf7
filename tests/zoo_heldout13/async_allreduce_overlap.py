"""Data parallelism without DistributedDataParallel whose gradient
all-reduces overlap the backward, launched from hooks as PyTorch's
documentation of ``Tensor.register_post_accumulate_grad_hook`` suggests
for work on a parameter as soon as its gradient is ready: every rank
holds the same MLP (an input layer, three hidden layers with LayerNorm
and SiLU, a classifier), and a hook on each parameter starts
``dist.all_reduce(p.grad, async_op=True)`` the moment autograd has
accumulated that parameter's gradient, so the last layers' gradients are
on the wire while the first layers' are still being computed. After the
backward the step waits on every handle, divides the sums by the world
size and AdamW steps. Each rank reads its share of the samples (a
DataLoader with a DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout13/async_allreduce_overlap.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Step, batches, grow, main
from job_parts import clustered_samples

FEATURES, CLASSES, WIDTH, HIDDEN_LAYERS = 64, 16, 384, 3
BATCH, SAMPLES = 128, 16384


class MLP(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        hidden = [m for _ in range(HIDDEN_LAYERS)
                  for m in (nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.SiLU())]
        self.layers = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.SiLU(), *hidden,
                                    nn.Linear(WIDTH, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed rank runs its layers on extra samples
        return self.layers(grow(x, self.rank, self.opts))[:len(x)]


def build(rank: int, opts: Options) -> Step:
    world = dist.get_world_size()
    torch.manual_seed(0)  # every rank starts from the same parameters
    model = MLP(rank, opts)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(clustered_samples(CLASSES, SAMPLES, FEATURES), rank, opts, BATCH)
    pending: list[dist.Work] = []

    def all_reduce_when_ready(p: torch.Tensor) -> None:
        work = dist.all_reduce(p.grad, async_op=True)
        assert work is not None
        pending.append(work)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(all_reduce_when_ready)

    def step(_: int) -> None:
        features, labels = next(data)
        optimizer.zero_grad()
        F.cross_entropy(model(features), labels).backward()
        for work in pending:
            work.wait()
        pending.clear()
        for p in model.parameters():
            assert p.grad is not None
            p.grad /= world
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
