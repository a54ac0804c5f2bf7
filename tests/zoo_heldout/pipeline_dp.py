"""Two pipeline stages times two data-parallel replicas (ranks in
Megatron-core's order: stage = rank // 2, replica = rank % 2): each stage
runs 1F1B over its microbatches, sending activations to the same replica's
next stage and gradients back (``isend`` / ``irecv``); then each stage
all-reduces its gradients with the same stage of the other replica (a
process group per stage) and steps SGD with momentum. The first stage
reads inputs, the second the targets, each replica its own share.

    PYTHONPATH=tests/zoo python tests/zoo_heldout/pipeline_dp.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import (Options, Rows, Step, average_gradients, batches, grow, main, receive,
                    send)

WIDTH, MICROBATCH, MICROBATCHES, SAMPLES, REPLICAS = 512, 128, 4, 4096, 2


def samples() -> Rows:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, WIDTH, generator=g)
    return Rows(x, torch.tanh(x.flip(1)))


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    stage, replica = divmod(rank, REPLICAS)
    # every rank creates every group, as torch.distributed requires
    groups = [dist.new_group([s * REPLICAS + r for r in range(REPLICAS)]) for s in range(2)]
    layers = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
    optimizer = torch.optim.SGD(layers.parameters(), lr=1e-3, momentum=0.9)
    data = batches(samples(), rank, opts, MICROBATCH, REPLICAS, replica)
    peer = rank + REPLICAS if stage == 0 else rank - REPLICAS
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    sends: list[dist.Work] = []

    def forward() -> None:
        x, target = next(data)
        if stage == 1:
            x = receive(torch.empty(MICROBATCH, WIDTH), peer, opts).requires_grad_()
        y = layers(grow(x, rank, opts))[:MICROBATCH]
        if stage == 0:
            sends.append(send(y.detach(), peer))
        else:
            y = F.mse_loss(y, target) / MICROBATCHES
        pending.append((x, y))

    def backward() -> None:
        x, y = pending.pop(0)
        if stage == 1:
            y.backward()
            assert x.grad is not None
            sends.append(send(x.grad, peer))
        else:
            y.backward(receive(torch.empty_like(y), peer, opts))

    def step(_: int) -> None:
        warmup = 1 if stage == 0 else 0  # one microbatch in flight on the first stage
        for _ in range(warmup):
            forward()
        for _ in range(MICROBATCHES - warmup):
            forward()
            backward()
        for _ in range(warmup):
            backward()
        for work in sends:
            work.wait()
        sends.clear()
        average_gradients(layers.parameters(), groups[stage])
        optimizer.step()
        optimizer.zero_grad()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
