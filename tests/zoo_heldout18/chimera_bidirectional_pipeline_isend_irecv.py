"""Bidirectional pipelines as Chimera runs them (Li and Hoefler, "Chimera:
Efficiently Training Large-Scale Neural Networks with Bidirectional
Pipelines", 2021), written with the non-blocking point-to-point of
PyTorch's "Writing Distributed Applications" tutorial (``dist.isend`` and
``dist.irecv``): a model of four stages is laid out twice over the four
ranks, once down (rank r holds stage r) and once up (rank r holds stage
3 - r), so that every rank holds two stages and each stage has two
replicas (stages 0 and 3 on ranks 0 and 3, stages 1 and 2 on ranks 1
and 2). Half of each batch's microbatches go down the first pipeline,
half up the second; every rank runs its two stages' forwards and then
their backwards in the order of the microbatches (Chimera's schedule for
two microbatches a pipeline: a down forward, then an up forward, for each
microbatch; the backwards likewise, last microbatch first), sending the
activations to the next stage and the gradients back to the previous
one. After the backwards each rank all-reduces its two stages' gradients
(flattened into one buffer) with the rank that holds their other
replicas (``dist.new_group``: ranks 0 and 3, 1 and 2), as Chimera
synchronises the replicated stages, and steps RAdam on both. Each stage
is a pre-norm residual feed-forward block; the first also projects the
input features, the last normalises and classifies them (cross-entropy).
Ranks 0 and 3, where the pipelines start and end, read the batches (a
DataLoader over the whole data set); ranks 1 and 2 read nothing.

    PYTHONPATH=tests/zoo python tests/zoo_heldout18/chimera_bidirectional_pipeline_isend_irecv.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Step, batches, grow, main, receive, send
from job_parts import FeedForwardBlock, clustered_samples, flat_gradients, unflatten_gradients

FEATURES, CLASSES, WIDTH, EXPANSION = 64, 16, 256, 2
STAGES, BATCH, MICROBATCHES, SAMPLES = 4, 64, 4, 32768
MICROBATCH = BATCH // MICROBATCHES
PER_PIPELINE = MICROBATCHES // 2
# floats in one message between stages: a microbatch's activations (or their gradients)
MESSAGE = MICROBATCH * WIDTH


def with_extra(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rank: int,
               opts: Options) -> torch.Tensor:
    """``layer(x)``; the slowed rank also runs ``layer`` on extra samples, in
    a call of their own (a batch of another size may be computed in another
    order), whose outputs are dropped (their backward runs, on zeros)."""
    grown = grow(x, rank, opts)
    y = layer(x)
    if len(grown) > len(x):
        y = torch.cat([y, layer(grown[len(x):])])[:len(x)]
    return y


class Stage(nn.Module):
    def __init__(self, index: int, rank: int, opts: Options) -> None:
        super().__init__()
        self.index, self.rank, self.opts = index, rank, opts
        torch.manual_seed(index)  # both replicas of a stage start alike
        self.inputs = nn.Linear(FEATURES, WIDTH) if index == 0 else nn.Identity()
        self.block = FeedForwardBlock(WIDTH, EXPANSION, F.gelu)
        self.head = (nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, CLASSES))
                     if index == STAGES - 1 else nn.Identity())

    def layers(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.inputs(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return with_extra(self.layers, x, self.rank, self.opts)


def build(rank: int, opts: Options) -> Step:
    assert dist.get_world_size() == STAGES
    # every rank creates every group, in the same order
    groups = [dist.new_group([r, STAGES - 1 - r]) for r in range(STAGES // 2)]
    group = groups[min(rank, STAGES - 1 - rank)]
    down, up = Stage(rank, rank, opts), Stage(STAGES - 1 - rank, rank, opts)
    # both replicas flatten their stages' gradients in the stages' order
    stages = sorted([down, up], key=lambda s: s.index)
    parameters = [p for s in stages for p in s.parameters()]
    optimizer = torch.optim.RAdam(parameters, lr=1e-3)
    ends = rank in (0, STAGES - 1)
    data: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = (
        batches(clustered_samples(CLASSES, SAMPLES, FEATURES), rank, opts, BATCH,
                replicas=1, replica=0) if ends else None)
    sent: list[tuple[dist.Work, torch.Tensor]] = []

    def pass_on(x: torch.Tensor, dst: int) -> None:
        x = x.detach().contiguous()
        sent.append((send(x, dst), x))

    def forward(stage: Stage, step: int, microbatch: int, features: torch.Tensor | None,
                labels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stage's forward of a microbatch (``step``: +1 down, -1 up);
        its output (the loss at the last stage) and its received input."""
        x: torch.Tensor | None = None
        if stage.index == 0:
            assert features is not None
            y = stage(features[microbatch * MICROBATCH:(microbatch + 1) * MICROBATCH])
        else:
            x = receive(torch.empty(MICROBATCH, WIDTH), rank - step, opts).requires_grad_()
            y = stage(x)
        if stage.index == STAGES - 1:
            assert labels is not None
            part = labels[microbatch * MICROBATCH:(microbatch + 1) * MICROBATCH]
            return F.cross_entropy(y, part) / MICROBATCHES, x
        pass_on(y, rank + step)
        return y, x

    def backward(stage: Stage, step: int, output: torch.Tensor, x: torch.Tensor | None) -> None:
        if stage.index == STAGES - 1:
            output.backward()
        else:
            output.backward(receive(torch.empty(MICROBATCH, WIDTH), rank + step, opts))
        if x is not None:
            assert x.grad is not None
            pass_on(x.grad, rank - step)

    def step(_: int) -> None:
        features = labels = None
        if data is not None:
            features, labels = next(data)
        optimizer.zero_grad()
        kept = []
        for m in range(PER_PIPELINE):
            # the down pipeline takes the first half of the batch, the up one the second
            kept.append((down, 1, *forward(down, 1, m, features, labels)))
            kept.append((up, -1, *forward(up, -1, PER_PIPELINE + m, features, labels)))
        for stage, direction, output, x in reversed(kept):
            backward(stage, direction, output, x)
        for work, _ in sent:
            work.wait()
        sent.clear()
        flat = flat_gradients(parameters)
        dist.all_reduce(flat, group=group)
        unflatten_gradients(flat, parameters)
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
