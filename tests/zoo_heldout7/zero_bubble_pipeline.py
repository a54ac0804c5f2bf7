"""A zero-bubble pipeline with ``torch.distributed.pipelining``, as its
documentation and the Zero Bubble paper set one up: a deep residual MLP
classifier cut into eight stages, two per rank in a V (rank r holds stage
r and stage 7 - r, so rank 0 holds the first and the last, and rank 3
hands its first stage's output to its second itself), run by
``ScheduleZBVZeroBubble`` over four microbatches. The schedule splits each
backward in two: the input's gradient first, sent on at once, and the
weights' gradients later, in what would be the pipeline's bubbles.
Activations go down the ranks and back up, gradients the other way; the
schedule does the point-to-point itself (``batch_isend_irecv``). Every
stage is a residual layer (a linear layer and GELU); the first also
projects the input features, the last holds a LayerNorm and the
classifier, and the loss, cross-entropy. Rank 0 reads the samples
(features and labels) from a DataLoader; each rank steps AdamW (fused)
over both of its stages.

    PYTHONPATH=tests/zoo python tests/zoo_heldout7/zero_bubble_pipeline.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

from launch import Options, Rows, Step, batches, grow, main

FEATURES, CLASSES, WIDTH = 64, 16, 512
BATCH, MICROBATCHES, SAMPLES = 384, 4, 6144
# floats in one message: a microbatch's activations (or their gradients)
MESSAGE = BATCH // MICROBATCHES * WIDTH


class Stage(nn.Module):
    """One stage: a residual layer, after the input projection on the
    first stage and before the classifier on the last. On the slowed rank
    the layer runs on extra samples."""

    def __init__(self, index: int, stages: int, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.inputs = nn.Linear(FEATURES, WIDTH) if index == 0 else None
        self.block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())
        self.classifier = (nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, CLASSES))
                           if index == stages - 1 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inputs is not None:
            x = self.inputs(x)
        # a sum, not a slice, last: the schedule frees the output's graph in place
        x = x + self.block(grow(x, self.rank, self.opts))[:len(x)]
        return x if self.classifier is None else self.classifier(x)


def samples() -> Rows:
    """Feature vectors around one of a few centres per class (classes that
    no single linear boundary separates), and their classes."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(CLASSES, 4, FEATURES, generator=g)
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    which = torch.randint(0, 4, (SAMPLES,), generator=g)
    return Rows(centres[labels, which] + 0.5 * torch.randn(SAMPLES, FEATURES, generator=g),
                labels)


def build(rank: int, opts: Options) -> Step:
    world = dist.get_world_size()
    stages = 2 * world
    indices = (rank, stages - 1 - rank)  # the V: down the ranks, then back up
    modules = []
    for index in indices:
        torch.manual_seed(index)
        modules.append(Stage(index, stages, rank, opts))
    # (list[Any]: the schedule's list is of a private base class)
    pipeline: list[Any] = [PipelineStage(module, index, stages, torch.device("cpu"))
                           for index, module in zip(indices, modules)]
    schedule = ScheduleZBVZeroBubble(pipeline, n_microbatches=MICROBATCHES,
                                     loss_fn=F.cross_entropy)
    optimizer = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-3,
                                  weight_decay=0.01, fused=True)
    # rank 0 holds the first stage and the last: it alone reads the data
    data = batches(samples(), rank, opts, BATCH, replicas=1, replica=0) if rank == 0 else None

    def step(_: int) -> None:
        optimizer.zero_grad()
        if data is not None:
            features, labels = next(data)
            schedule.step(features, target=labels)
        else:
            schedule.step()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
