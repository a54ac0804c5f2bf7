"""A temporal convolutional network (TCN) for time-series forecasting, trained
with hierarchical post-local SGD, as users set it up after PyTorch's DDP
communication hooks documentation (``post_localSGD_hook`` with
``PostLocalSGDOptimizer`` and a ``PeriodicModelAverager``): for the first
two iterations DDP all-reduces the gradients over every rank; after them
each pair of ranks (ranks 0-1 and 2-3, as two hosts' ranks would be)
all-reduces its gradients within the pair only, and every second iteration
the optimizer averages the parameters over every rank. The network follows
the TCN paper's PyTorch code (Bai, Kolter and Koltun), without its weight
normalisation: residual blocks of two dilated causal 1-d convolutions, each
followed by a ReLU and dropout (three blocks, dilations 1, 2 and 4, to keep
the job small), with a 1x1 convolution on the shortcut where the width
changes, then a 1x1 convolution to the forecast; it predicts every series'
next value at each time step (mean-square error). SGD with momentum (fused)
under ``PostLocalSGDOptimizer``, as the documentation's example has it.
Windows of multivariate series a DataLoader reads with a
DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout6/post_local_sgd_tcn.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (PostLocalSGDState,
                                                                             post_localSGD_hook)
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

SERIES, WIDTH, KERNEL, DILATIONS, LENGTH, BATCH, WINDOWS = 8, 48, 3, (1, 2, 4), 128, 16, 1024
GLOBAL_ITERATIONS, PERIOD, PAIR = 2, 2, 2  # all-reduce over all ranks first; average every PERIOD


class TemporalBlock(nn.Module):
    def __init__(self, inputs: int, outputs: int, dilation: int) -> None:
        super().__init__()
        self.padding = (KERNEL - 1) * dilation  # on the left only: causal
        self.conv1 = nn.Conv1d(inputs, outputs, KERNEL, dilation=dilation)
        self.conv2 = nn.Conv1d(outputs, outputs, KERNEL, dilation=dilation)
        self.dropout = nn.Dropout(0.2)
        self.downsample = nn.Conv1d(inputs, outputs, 1) if inputs != outputs else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dropout(F.relu(self.conv1(F.pad(x, (self.padding, 0)))))
        y = self.dropout(F.relu(self.conv2(F.pad(y, (self.padding, 0)))))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(y + shortcut)


class TCN(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        widths = (SERIES, *(WIDTH for _ in DILATIONS))
        self.blocks = nn.Sequential(*(TemporalBlock(a, b, d) for a, b, d in
                                      zip(widths, widths[1:], DILATIONS)))
        self.forecast = nn.Conv1d(WIDTH, SERIES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed rank forecasts extra windows
        return self.forecast(self.blocks(grow(x, self.rank, self.opts)))[:len(x)]


def windows() -> Rows:
    """Windows of noisy sums of sines (each series its own periods and
    phases), and the same windows one time step later."""
    g = torch.Generator().manual_seed(0)
    periods = 8 + 56 * torch.rand(WINDOWS, SERIES, 2, 1, generator=g)
    phases = 6.28 * torch.rand(WINDOWS, SERIES, 2, 1, generator=g)
    time = torch.arange(LENGTH + 1).float()
    series = torch.sin(6.28 * time / periods + phases).sum(2)
    series += 0.1 * torch.randn(series.shape, generator=g)
    return Rows(series[..., :-1].contiguous(), series[..., 1:].contiguous())


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    pair, _ = dist.new_subgroups(group_size=PAIR)
    model = DistributedDataParallel(TCN(rank, opts))
    state = PostLocalSGDState(process_group=None, subgroup=pair,
                              start_localSGD_iter=GLOBAL_ITERATIONS)
    model.register_comm_hook(state, post_localSGD_hook)
    averager = PeriodicModelAverager(period=PERIOD, warmup_steps=GLOBAL_ITERATIONS)
    local = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)
    optimizer = PostLocalSGDOptimizer(local, averager)
    data = batches(windows(), rank, opts, BATCH)

    def step(_: int) -> None:
        inputs, targets = next(data)
        optimizer.zero_grad()
        F.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
