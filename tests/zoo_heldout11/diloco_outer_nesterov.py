"""DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training
of Language Models", 2023): each rank trains its own copy of the model on
its own share of the data with AdamW (the inner optimizer) and talks to
the others only once every H = 2 steps. Then each rank's pseudo-gradient,
the parameters at the start of the round less its current ones, is
averaged over the ranks (``all_reduce`` of each parameter's, divided by
the world), every rank puts its parameters back to the round's start, and
the outer optimizer, SGD with Nesterov momentum (learning rate 0.7,
momentum 0.9, as the paper's), steps them by the averaged pseudo-gradient:
all ranks hold the same parameters again when the next round starts. The
model is a fixed-window neural language model (Bengio et al. 2003): the
embeddings of the previous sixteen tokens, concatenated, through two tanh
layers to the next token's logits (cross-entropy); each rank reads its
share of the sequences (a DataLoader with a DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout11/diloco_outer_nesterov.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Rows, Step, batches, grow, main
from job_parts import markov_sequences

VOCAB, WINDOW, EMBEDDING, HIDDEN = 512, 16, 64, 512
BATCH, SEQUENCES = 128, 16384
ROUND = 2  # H: inner steps between two outer steps


class WindowLanguageModel(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.embedding = nn.Embedding(VOCAB, EMBEDDING)
        self.hidden = nn.Sequential(nn.Linear(WINDOW * EMBEDDING, HIDDEN), nn.Tanh(),
                                    nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.logits = nn.Linear(HIDDEN, VOCAB)

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        x = self.embedding(window).flatten(1)
        # the slowed rank runs its layers on extra rows
        return self.logits(self.hidden(grow(x, self.rank, self.opts)))[:len(x)]


def windows() -> Rows:
    """Sixteen tokens of a Markov chain, and the token after them."""
    tokens, following = markov_sequences(VOCAB, SEQUENCES, WINDOW).tensors
    return Rows(tokens, following[:, -1].contiguous())


def build(rank: int, opts: Options) -> Step:
    world = dist.get_world_size()
    torch.manual_seed(0)  # every rank starts from the same parameters
    model = WindowLanguageModel(rank, opts)
    parameters = list(model.parameters())
    inner = torch.optim.AdamW(parameters, lr=1e-3, weight_decay=0.1)
    outer = torch.optim.SGD(parameters, lr=0.7, momentum=0.9, nesterov=True)
    start = [p.detach().clone() for p in parameters]  # the parameters the round started from
    data = batches(windows(), rank, opts, BATCH)

    def outer_step() -> None:
        with torch.no_grad():
            for p, p0 in zip(parameters, start):
                pseudo_gradient = p0 - p
                dist.all_reduce(pseudo_gradient)
                pseudo_gradient /= world
                p.copy_(p0)
                p.grad = pseudo_gradient
        outer.step()
        outer.zero_grad()
        with torch.no_grad():
            for p, p0 in zip(parameters, start):
                p0.copy_(p)

    def step(i: int) -> None:
        window, following = next(data)
        inner.zero_grad()
        F.cross_entropy(model(window), following).backward()
        inner.step()
        if i % ROUND == ROUND - 1:
            outer_step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
