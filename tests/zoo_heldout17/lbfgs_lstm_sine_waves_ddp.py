"""An LSTM trained with L-BFGS under DistributedDataParallel, after
PyTorch's ``time_sequence_prediction`` example (two stacked LSTM cells of
51 units and a linear layer that predict each next value of sine waves,
trained with ``torch.optim.LBFGS`` at a learning rate of 0.8 on the
mean-square error), here a two-layer ``nn.LSTM`` of 51 units (the
example's two cells over the whole sequence) and a linear layer, each
rank on its share of the waves. L-BFGS calls its closure once an
iteration, several times an optimizer step (here at most two iterations,
no line search, a history of ten updates): each call zeroes the gradients and runs a forward and a backward, in which DDP
averages the gradients; the closure also all-reduces the loss
(``all_reduce`` of the detached value, divided by the world), so that
every rank's L-BFGS sees the global loss and gradients and takes the same
decisions (its tolerances end a step early on every rank alike). The
waves are sines of a random phase sampled at unit steps, with a period
of 20 as in the example; a DataLoader with a DistributedSampler reads
each rank's share of them, one batch an optimizer step.

    PYTHONPATH=tests/zoo python tests/zoo_heldout17/lbfgs_lstm_sine_waves_ddp.py --out DIR
"""
from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

HIDDEN, LAYERS, LENGTH, PERIOD = 51, 2, 50, 20.0
WAVES, BATCH, ITERATIONS, HISTORY = 4096, 32, 2, 10


class Sequence(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.lstm = nn.LSTM(1, HIDDEN, LAYERS, batch_first=True)
        self.linear = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grown = grow(x, self.rank, self.opts)
        h, _ = self.lstm(x)
        if len(grown) > len(x):
            # the slowed rank runs its LSTM on extra waves, in a call of their
            # own (a batch of another size may be computed in another order);
            # their outputs are dropped, their backward runs on zeros
            extra, _ = self.lstm(grown[len(x):])
            h = torch.cat([h, extra])[:len(x)]
        return self.linear(h)


def waves() -> Rows:
    g = torch.Generator().manual_seed(0)
    phase = torch.randint(-4 * int(PERIOD), 4 * int(PERIOD), (WAVES, 1), generator=g)
    t = torch.arange(LENGTH + 1) + phase
    y = torch.sin(t / PERIOD * 2 * math.pi).float().unsqueeze(2)
    return Rows(y[:, :-1].contiguous(), y[:, 1:].contiguous())


def build(rank: int, opts: Options) -> Step:
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(Sequence(rank, opts))
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.8, max_iter=ITERATIONS,
                                  history_size=HISTORY)
    data = batches(waves(), rank, opts, BATCH)

    def step(_: int) -> None:
        inputs, targets = next(data)

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = F.mse_loss(model(inputs), targets)
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            return total / world
        optimizer.step(closure)
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
