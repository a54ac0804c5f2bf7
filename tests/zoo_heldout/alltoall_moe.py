"""An expert-parallel mixture-of-experts layer: one expert MLP per rank and
a replicated top-1 router; each rank routes its tokens, sends every expert
its share (a fixed capacity per expert, overflow dropped, gaps zero) with
``all_to_all_single`` (in an autograd function: backward sends the
gradients back the same way), the experts run, and the results come back.
The router's and the embedding's gradients are all-reduced; each expert's
stay on its rank; Adam.

    PYTHONPATH=tests/zoo python tests/zoo_heldout/alltoall_moe.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Rows, Step, average_gradients, batches, grow, main

WIDTH, TOKENS, CAPACITY, SAMPLES = 256, 256, 96, 8192


def samples() -> Rows:
    g = torch.Generator().manual_seed(0)
    return Rows(torch.randn(SAMPLES, WIDTH, generator=g))


class AllToAll(torch.autograd.Function):
    """Each rank's i-th block of rows goes to rank i; backward likewise."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return AllToAll.apply(grad)


class MoE(nn.Module):
    def __init__(self, world: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # the replicated parts start alike
        self.world = world
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.router = nn.Linear(WIDTH, world, bias=False)
        torch.manual_seed(1 + dist.get_rank())
        self.expert = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                    nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor, rank: int, opts: Options) -> torch.Tensor:
        h = self.embed(x)
        gate = F.softmax(self.router(h), dim=-1)
        weight, choice = gate.max(dim=-1)
        slots, dispatch = self.slots(choice)
        outbox = torch.zeros(self.world * CAPACITY, WIDTH).index_copy(0, slots, h[dispatch])
        inbox = AllToAll.apply(outbox)
        done = self.expert(grow(inbox, rank, opts))[:len(inbox)]
        back = AllToAll.apply(done)
        combined = torch.zeros_like(h).index_copy(0, dispatch, back[slots])
        return h + weight.unsqueeze(-1) * combined

    def slots(self, choice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For the tokens that fit their expert's capacity: their slot in
        the send buffer (expert-major) and their index."""
        order = torch.argsort(choice, stable=True)
        experts = choice[order]
        first = torch.searchsorted(experts, torch.arange(self.world))
        position = torch.arange(len(order)) - first[experts]
        fits = position < CAPACITY
        return experts[fits] * CAPACITY + position[fits], order[fits]


def build(rank: int, opts: Options) -> Step:
    model = MoE(dist.get_world_size())
    replicated = [*model.embed.parameters(), *model.router.parameters()]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = batches(samples(), rank, opts, TOKENS)

    def step(_: int) -> None:
        (x,) = next(data)
        model(x, rank, opts).square().mean().backward()
        average_gradients(replicated)
        optimizer.step()
        optimizer.zero_grad()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
