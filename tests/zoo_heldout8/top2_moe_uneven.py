"""An expert-parallel mixture-of-experts classifier with top-2 routing and
uneven, data-dependent exchanges, as GShard and the Switch Transformer
route tokens and as PyTorch's ``all_to_all_single`` with split sizes serves
them: one expert MLP per rank, a replicated token embedding, router and
classifier. Each rank's router sends each of its tokens to its two most
likely experts (their gate values renormalised to weights); an expert
takes at most a capacity of 1.25x its even share from each rank (the rest
of its tokens are dropped for that expert, as with a capacity factor),
so how many tokens go from each rank to each expert changes every batch.
The ranks first exchange those counts (an ``all_to_all_single`` of one
number per pair), then the tokens, with ``all_to_all_single`` given the
input and output split sizes (in an autograd function: backward sends the
gradients back with the splits swapped); the experts run and the results
come back the same way and are summed with their weights. The loss is
cross-entropy plus the Switch Transformer's load-balancing loss. The
replicated parameters' gradients are all-reduced by hand (each expert's
stay on its rank); Adam. Samples a DataLoader reads with a
DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout8/top2_moe_uneven.py --out DIR
"""
from __future__ import annotations

import math
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Rows, Step, average_gradients, batches, grow, main

FEATURES, WIDTH, CLASSES = 64, 256, 16
TOKENS, SAMPLES = 256, 8192  # TOKENS: a rank's batch
TOP, CAPACITY_FACTOR, BALANCE = 2, 1.25, 0.01


class AllToAll(torch.autograd.Function):
    """Rows to the ranks in blocks of ``sent`` rows, ``received`` rows back
    from each; backward the other way, with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sent: list[int], received: list[int]) -> torch.Tensor:
        ctx.sent, ctx.received = sent, received
        out = x.new_empty(sum(received), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=received,
                               input_split_sizes=sent)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return AllToAll.apply(grad, ctx.received, ctx.sent), None, None


class Top2MoE(nn.Module):
    def __init__(self, world: int, rank: int, opts: Options) -> None:
        super().__init__()
        self.world, self.rank, self.opts = world, rank, opts
        torch.manual_seed(0)  # the replicated parts start alike
        self.embed = nn.Linear(FEATURES, WIDTH)
        self.router = nn.Linear(WIDTH, world, bias=False)
        self.head = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, CLASSES))
        torch.manual_seed(1 + rank)
        self.expert = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                    nn.Linear(4 * WIDTH, WIDTH))
        self.capacity = math.ceil(CAPACITY_FACTOR * TOP * TOKENS / world)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(x)
        probabilities = F.softmax(self.router(h), dim=-1)
        gates, experts = probabilities.topk(TOP, dim=-1)
        gates = gates / gates.sum(-1, keepdim=True)
        # the (token, expert) pairs, grouped by expert, each expert's first
        # `capacity` kept
        expert, order = experts.flatten().sort(stable=True)
        counts = torch.bincount(expert, minlength=self.world)
        first = torch.cumsum(counts, 0) - counts
        kept = (torch.arange(len(expert)) - first[expert]) < self.capacity
        order, expert = order[kept], expert[kept]
        token = order // TOP
        sent = torch.bincount(expert, minlength=self.world)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent)  # how many tokens come from each rank
        inbox = AllToAll.apply(h[token], sent.tolist(), received.tolist())
        done = self.expert(grow(inbox, self.rank, self.opts))[:len(inbox)]
        back = AllToAll.apply(done, received.tolist(), sent.tolist())
        weights = gates.flatten()[order].unsqueeze(-1)
        mixed = torch.zeros_like(h).index_add(0, token, weights * back)
        # Switch's auxiliary loss: the share of tokens each expert is sent
        # first times its mean gate probability
        share = torch.bincount(experts[:, 0], minlength=self.world).float() / len(x)
        balance = self.world * (share * probabilities.mean(0)).sum()
        return self.head(h + mixed), balance


def samples() -> Rows:
    """Feature vectors around one of a few centres per class, and their
    classes: tokens of one class tend to go to the same experts."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(CLASSES, 4, FEATURES, generator=g)
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    which = torch.randint(0, 4, (SAMPLES,), generator=g)
    return Rows(centres[labels, which] + 0.5 * torch.randn(SAMPLES, FEATURES, generator=g),
                labels)


def build(rank: int, opts: Options) -> Step:
    model = Top2MoE(dist.get_world_size(), rank, opts)
    replicated = [p for name, p in model.named_parameters() if not name.startswith("expert.")]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = batches(samples(), rank, opts, TOKENS)

    def step(_: int) -> None:
        x, labels = next(data)
        optimizer.zero_grad()
        logits, balance = model(x)
        (F.cross_entropy(logits, labels) + BALANCE * balance).backward()
        average_gradients(replicated)
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
