"""Knowledge distillation from an exponential-moving-average teacher kept
by one rank: every rank trains the same student under
DistributedDataParallel with a distillation loss (cross-entropy on the
labels plus the KL divergence from the teacher's softened predictions, at
temperature 2), and after each optimizer step rank 0 alone updates the
teacher as the EMA of the student (decay 0.99) and ``dist.broadcast``-s
each of the teacher's parameters to the other ranks, which use them in
the next step. Student and teacher are the same MLP (three hidden layers
with LayerNorm and GELU); each rank reads its share of the samples.

    PYTHONPATH=tests/zoo python tests/zoo_heldout12/broadcast_from_leader_ema.py --out DIR
"""
from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from launch import Options, Step, batches, grow, main
from job_parts import clustered_samples

FEATURES, CLASSES, WIDTH = 64, 16, 384
BATCH, SAMPLES = 128, 16384
DECAY, TEMPERATURE, ALPHA = 0.99, 2.0, 0.5
LEADER = 0


class MLP(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.layers = nn.Sequential(
            nn.Linear(FEATURES, WIDTH), nn.LayerNorm(WIDTH), nn.GELU(),
            nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.GELU(),
            nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.GELU(),
            nn.Linear(WIDTH, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed rank runs its layers on extra samples
        return self.layers(grow(x, self.rank, self.opts))[:len(x)]


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    student = MLP(rank, opts)
    teacher = copy.deepcopy(student).requires_grad_(False)
    model = DDP(student)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(clustered_samples(CLASSES, SAMPLES, FEATURES), rank, opts, BATCH)

    def distillation_loss(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            soft_targets = F.log_softmax(teacher(features) / TEMPERATURE, dim=1)
        logits = model(features)
        soft = F.kl_div(F.log_softmax(logits / TEMPERATURE, dim=1), soft_targets,
                        reduction="batchmean", log_target=True) * TEMPERATURE ** 2
        return ALPHA * F.cross_entropy(logits, labels) + (1 - ALPHA) * soft

    def update_teacher() -> None:
        with torch.no_grad():
            for t, s in zip(teacher.parameters(), student.parameters()):
                if rank == LEADER:
                    t.lerp_(s, 1 - DECAY)
                dist.broadcast(t, src=LEADER)

    def step(_: int) -> None:
        features, labels = next(data)
        optimizer.zero_grad()
        distillation_loss(features, labels).backward()
        optimizer.step()
        update_teacher()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
