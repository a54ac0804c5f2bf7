"""Stochastic weight averaging under DistributedDataParallel, as PyTorch's
``torch.optim.swa_utils`` documentation writes it (Izmailov et al.,
"Averaging Weights Leads to Wider Optima and Better Generalization",
2018): a small convolutional net with BatchNorm (three 3x3 convolutions,
each followed by BatchNorm and ReLU, the last two strided, global average
pooling and a linear classifier) trained under DDP with SGD (momentum
and weight decay), its learning rate annealed by CosineAnnealingLR until
SWA starts and by SWALR after. From the second traced iteration
(``ProfilerStep#3``) on, every iteration after the optimizer step folds
the model's weights into an ``AveragedModel`` (the running mean of the
weights since SWA started) and recomputes the averaged model's BatchNorm
statistics with ``update_bn`` over the iteration's batch (a forward pass
in training mode, without gradients), as the documentation does before
the averaged model is used. BatchNorm's running statistics are buffers,
which DDP broadcasts from rank 0 before each forward (gloo on CPU has no
``SyncBatchNorm``: it takes only GPU inputs). The images are 16x16
three-channel tensors around one of four centres per class; each rank
reads its share of them (a DataLoader with a DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout13/ddp_swa_bn_update.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

from launch import Options, Rows, Step, batches, grow, main
from job_parts import clustered_samples

CHANNELS, SIDE, WIDTHS, CLASSES = 3, 16, (16, 32, 64), 10
BATCH, IMAGES = 32, 8192
SWA_START = 3  # ProfilerStep#3: the launcher traces ProfilerStep#2 on


class ConvNet(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        widths = (CHANNELS, *WIDTHS)
        self.convs = nn.ModuleList(
            nn.Conv2d(a, b, 3, stride=1 if i == 0 else 2, padding=1, bias=False)
            for i, (a, b) in enumerate(zip(widths, widths[1:])))
        self.norms = nn.ModuleList(nn.BatchNorm2d(b) for b in WIDTHS)
        self.head = nn.Linear(WIDTHS[-1], CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, norm in zip(self.convs, self.norms):
            # the slowed rank convolves extra images, dropped before BatchNorm
            # (whose batch statistics they would change)
            x = F.relu(norm(conv(grow(x, self.rank, self.opts))[:len(x)]))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def images() -> Rows:
    features, labels = clustered_samples(CLASSES, IMAGES, CHANNELS * SIDE * SIDE).tensors
    return Rows(features.view(-1, CHANNELS, SIDE, SIDE), labels)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    net = ConvNet(rank, opts)
    model = DDP(net)
    swa_model = AveragedModel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
    swa_scheduler = SWALR(optimizer, swa_lr=0.05, anneal_epochs=2)
    data = batches(images(), rank, opts, BATCH)

    def step(i: int) -> None:
        x, labels = next(data)
        optimizer.zero_grad()
        F.cross_entropy(model(x), labels).backward()
        optimizer.step()
        if i >= SWA_START:
            swa_model.update_parameters(net)
            swa_scheduler.step()
            with torch.no_grad():
                update_bn([x], swa_model)
        else:
            scheduler.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
