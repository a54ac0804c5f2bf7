"""Data parallelism by majority vote on the gradients' signs (signSGD with
majority vote: Bernstein, Zhao, Azizzadenesheli and Anandkumar, "signSGD
with Majority Vote is Communication Efficient and Fault Tolerant", 2019),
written as a ``torch.optim.Optimizer`` of its own, without
DistributedDataParallel: each rank keeps the momentum of its own
gradients (Signum: an exponential moving average, 0.9), takes its signs
as 8-bit integers (-1, 0 or 1; one buffer for all the parameters) and
all-reduces them (``dist.all_reduce`` of an ``int8`` tensor, a sum over
the ranks); every rank then moves each parameter by the learning rate
against the sign of the vote (a tie moves it not at all), with the weight
decay of the paper's Signum, so that every rank's parameters stay the
same without ever exchanging a float. The model is the convolutional
network of PyTorch's "Training a Classifier" (CIFAR-10) tutorial, wider
(two 5x5 convolutions of 16 and 32 channels, each with ReLU and 2x2
max-pooling, then three linear layers, cross-entropy), on 32x32 colour
images around one of four centres per class (ten classes); each rank
reads its share of them (a DataLoader with a DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout18/signum_majority_vote_int8_allreduce.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Rows, Step, batches, grow, main, train_step
from job_parts import clustered_samples

CHANNELS, SIDE, CLASSES, IMAGES, BATCH = 3, 32, 10, 16384, 48


class MajorityVoteSignum(torch.optim.Optimizer):
    """Signum whose update direction is the majority vote of every rank's momentum signs."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float, momentum: float = 0.9,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        assert closure is None
        params = [(p, group) for group in self.param_groups for p in group["params"]
                  if p.grad is not None]
        signs = []
        for p, group in params:
            state = self.state[p]
            if "momentum" not in state:
                state["momentum"] = torch.zeros_like(p)
            state["momentum"].mul_(group["momentum"]).add_(p.grad, alpha=1 - group["momentum"])
            signs.append(state["momentum"].sign().to(torch.int8).flatten())
        votes = torch.cat(signs)
        dist.all_reduce(votes)  # the sum of the ranks' signs, each entry in [-world, world]
        for (p, group), vote in zip(params, votes.split([p.numel() for p, _ in params])):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(vote.sign().view_as(p).to(p.dtype), alpha=-group["lr"])


class Net(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.conv1, self.conv2 = nn.Conv2d(CHANNELS, 16, 5), nn.Conv2d(16, 32, 5)
        self.fc1, self.fc2, self.fc3 = nn.Linear(32 * 5 * 5, 240), nn.Linear(240, 168), \
            nn.Linear(168, CLASSES)

    def layers(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed rank also classifies extra images, in a call of their own
        # (a batch of another size may be computed in another order), whose
        # outputs are dropped (their backward runs, on zeros)
        grown = grow(x, self.rank, self.opts)
        y = self.layers(x)
        if len(grown) > len(x):
            y = torch.cat([y, self.layers(grown[len(x):])])[:len(x)]
        return y


def images() -> Rows:
    samples, labels = clustered_samples(CLASSES, IMAGES, CHANNELS * SIDE * SIDE).tensors
    return Rows(samples.view(IMAGES, CHANNELS, SIDE, SIDE), labels)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)  # every rank starts from the same parameters
    model = Net(rank, opts)
    optimizer = MajorityVoteSignum(model.parameters(), lr=1e-4, momentum=0.9,
                                   weight_decay=1e-4)
    data = batches(images(), rank, opts, BATCH)

    def step(_: int) -> None:
        features, labels = next(data)
        train_step(lambda: F.cross_entropy(model(features), labels), optimizer, opts)
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
