"""An interleaved zero-bubble pipeline with ``torch.distributed.pipelining``,
as its documentation sets up a multi-stage schedule: a stack of pre-norm
feed-forward blocks (as in a Transformer: LayerNorm, a linear layer four
times wider, GELU, a linear layer back, the residual) cut into eight
stages, two per rank in a loop (rank r holds stage r and stage r + 4, so
rank 3 hands stage 3's output back to rank 0's stage 4), run by
``ScheduleInterleavedZeroBubble`` (the ZB1P schedule of the Zero Bubble
paper) over four microbatches. Each backward is split in two: the input's
gradient first, sent on to the previous stage at once, and the weights'
gradients later, in what would otherwise be the pipeline's bubbles. The
schedule does the point-to-point itself (``batch_isend_irecv``):
activations go forward round the ring, gradients back. The first stage
also embeds the input features, the last normalises and classifies them
(cross-entropy). Rank 0 reads the features and rank 3 (the last stage) the
labels, from the same DataLoader order; each rank steps AdamW (fused) over
both of its stages.

    PYTHONPATH=tests/zoo python tests/zoo_heldout9/interleaved_zero_bubble_pipeline.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble

from launch import Options, Rows, Step, batches, grow, main

FEATURES, CLASSES, WIDTH = 64, 16, 256
BATCH, MICROBATCHES, SAMPLES = 256, 4, 8192
# floats in one message: a microbatch's activations (or their gradients)
MESSAGE = BATCH // MICROBATCHES * WIDTH


class Stage(nn.Module):
    """One stage: a pre-norm feed-forward block, after the input projection
    on the first stage and before the classifier on the last. On the
    slowed rank the block runs on extra samples."""

    def __init__(self, index: int, stages: int, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.inputs = nn.Linear(FEATURES, WIDTH) if index == 0 else None
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH))
        self.classifier = (nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, CLASSES))
                           if index == stages - 1 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inputs is not None:
            x = self.inputs(x)
        x = x + self.mlp(self.norm(grow(x, self.rank, self.opts)))[:len(x)]
        return x if self.classifier is None else self.classifier(x)


def samples() -> Rows:
    """Feature vectors around one of a few centres per class, and their classes."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(CLASSES, 4, FEATURES, generator=g)
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    which = torch.randint(0, 4, (SAMPLES,), generator=g)
    return Rows(centres[labels, which] + 0.5 * torch.randn(SAMPLES, FEATURES, generator=g),
                labels)


def build(rank: int, opts: Options) -> Step:
    world = dist.get_world_size()
    stages = 2 * world
    indices = (rank, rank + world)  # the loop: round the ranks twice
    modules = []
    for index in indices:
        torch.manual_seed(index)
        modules.append(Stage(index, stages, rank, opts))
    # (list[Any]: the schedule's list is of a private base class)
    pipeline: list[Any] = [PipelineStage(module, index, stages, torch.device("cpu"))
                           for index, module in zip(indices, modules)]
    schedule = ScheduleInterleavedZeroBubble(pipeline, n_microbatches=MICROBATCHES,
                                             loss_fn=F.cross_entropy)
    optimizer = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-3,
                                  weight_decay=0.01, fused=True)
    # the first stage needs the features, the last the labels: both ranks read
    # the same batches
    first, last = rank == 0, rank == world - 1
    data = (batches(samples(), rank, opts, BATCH, replicas=1, replica=0)
            if first or last else None)

    def step(_: int) -> None:
        optimizer.zero_grad()
        if data is None:
            schedule.step()
        else:
            features, labels = next(data)
            if first:
                schedule.step(features)
            else:
                schedule.step(target=labels)
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
