"""DDP with gradient accumulation: each step runs three microbatches, the
first two under ``no_sync()`` (gradients accumulate locally), the last
one synchronised (DDP all-reduces the summed gradients), then SGD with
momentum; a residual MLP regressor on feature vectors a DataLoader reads.

    PYTHONPATH=tests/zoo python tests/zoo_heldout/ddp_accumulate.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

FEATURES, HIDDEN, BLOCKS, MICROBATCH, ACCUMULATE, SAMPLES = 256, 512, 2, 64, 3, 4096


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.silu(self.up(self.norm(x))))


def regressor() -> nn.Sequential:
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), *(Residual() for _ in range(BLOCKS)),
                         nn.Linear(HIDDEN, 1))


def samples() -> Rows:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return Rows(x, x[:, :8].sum(dim=1, keepdim=True))


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(regressor())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    data = batches(samples(), rank, opts, MICROBATCH)

    def microbatch() -> None:
        x, y = next(data)
        prediction = model(grow(x, rank, opts))[:len(x)]
        (F.mse_loss(prediction, y) / ACCUMULATE).backward()

    def step(_: int) -> None:
        with model.no_sync():
            for _ in range(ACCUMULATE - 1):
                microbatch()
        microbatch()
        optimizer.step()
        optimizer.zero_grad()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
