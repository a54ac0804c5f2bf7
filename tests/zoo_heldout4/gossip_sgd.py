"""Decentralised (gossip) SGD on a ring, as in D-PSGD, written with the
point-to-point sends of PyTorch's "Writing Distributed Applications"
tutorial: every rank trains its own copy of a raw-waveform audio
classifier (the M5 network of PyTorch's speech-command tutorial, narrower:
1-d convolutions and max-pools, without its BatchNorm, whose running
statistics gossip would not average) on its share of the clips, steps SGD
with momentum, then sends its parameters, flattened, to both ring
neighbours and replaces them by the mean of its own and theirs. No rank
waits on a global all-reduce: each hears only from its neighbours.

    PYTHONPATH=tests/zoo python tests/zoo_heldout4/gossip_sgd.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from launch import Options, Rows, Step, batches, grow, main, receive, send

RATE, CLASSES, WIDTH, BATCH, CLIPS = 4000, 10, 32, 32, 512


def block(inputs: int, outputs: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv1d(inputs, outputs, kernel, stride), nn.ReLU(), nn.MaxPool1d(4)]


class M5(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            *block(1, WIDTH, 80, stride=16), *block(WIDTH, WIDTH, 3),
            *block(WIDTH, 2 * WIDTH, 3), nn.Conv1d(2 * WIDTH, 2 * WIDTH, 3), nn.ReLU(),
            nn.AdaptiveAvgPool1d(1), nn.Flatten())
        self.classifier = nn.Linear(2 * WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.classifier(self.features(x)), dim=1)


PARAMETERS = sum(p.numel() for p in M5().parameters())  # floats in one message


def clips() -> Rows:
    """One-second clips: a class's tone (its own pitch) in noise."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, CLASSES, (CLIPS,), generator=g)
    t = torch.arange(RATE) / RATE
    pitch = (200.0 + 90.0 * labels).view(-1, 1)
    phase = torch.rand(CLIPS, 1, generator=g) * 6.28
    waves = torch.sin(6.28 * pitch * t + phase) + 0.5 * torch.randn(CLIPS, RATE, generator=g)
    return Rows(waves.unsqueeze(1), labels)


def gossip(model: nn.Module, opts: Options) -> None:
    """Average the parameters with both ring neighbours'."""
    rank, world = dist.get_rank(), dist.get_world_size()
    neighbours = ((rank + 1) % world, (rank - 1) % world)
    own = parameters_to_vector(model.parameters()).detach()
    sent = [send(own, peer) for peer in neighbours]
    total = own.clone()
    for peer in neighbours:
        total += receive(torch.empty(PARAMETERS), peer, opts)
    for work in sent:
        work.wait()
    with torch.no_grad():
        vector_to_parameters(total / (1 + len(neighbours)), model.parameters())


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)  # every rank starts from the same parameters
    model = M5()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = batches(clips(), rank, opts, BATCH)

    def step(_: int) -> None:
        x, labels = next(data)
        optimizer.zero_grad()
        # the slowed rank classifies extra clips
        F.nll_loss(model(grow(x, rank, opts))[:len(x)], labels).backward()
        optimizer.step()
        gossip(model, opts)
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
