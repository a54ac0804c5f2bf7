"""Two data-parallel replicas of a two-stage GPipe pipeline (Huang et al.,
"GPipe: Efficient Training of Giant Neural Networks using Pipeline
Parallelism", 2019) written with the non-blocking point-to-point of
PyTorch's "Writing Distributed Applications" tutorial (``dist.isend`` and
``dist.irecv``), its second stage under activation checkpointing
(``torch.utils.checkpoint``, as GPipe re-materialises each stage's
activations in the backward): rank = 2 x replica + stage, so ranks 0 -> 1
and 2 -> 3 are the pipelines. Four microbatches a batch, all their
forwards first, then all their backwards in reverse order: the first
stage sends each microbatch's activations to the second as soon as it has
them (``isend``, waited on after the last forward), the second receives
them (``irecv``), runs its forward under ``checkpoint(...,
use_reentrant=True)`` (it keeps only its input and recomputes the rest in
the backward), and after the last microbatch's loss runs the backwards
from the last microbatch to the first, sending each input's gradient back
(``isend``), which the first stage receives (``irecv``) before that
microbatch's backward. Each stage is a pre-norm feed-forward block
(LayerNorm, a linear layer four times wider, GELU, a linear layer back,
the residual); the first stage also projects the input features, the
last normalises and classifies them. After the schedule each stage's
gradients, flattened into one buffer, are averaged with the same stage of
the other replica (``all_reduce`` in a group of the two, ``dist.new_group``),
then Adam. Both stages of a replica read its batches (a DataLoader over
its half of the samples): the first the features, the last the labels.

    PYTHONPATH=tests/zoo python tests/zoo_heldout15/pipeline_two_stage_dp2_isend_irecv_gpipe_activation_checkpoint.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from launch import Options, Step, batches, grow, main, receive, send
from job_parts import FeedForwardBlock, clustered_samples, flat_gradients, unflatten_gradients

FEATURES, CLASSES, WIDTH = 64, 16, 256
BATCH, MICROBATCHES, SAMPLES = 256, 4, 8192
MICROBATCH = BATCH // MICROBATCHES
# floats in one message: a microbatch's activations (or their gradients)
MESSAGE = MICROBATCH * WIDTH
STAGES = 2


class Stage(nn.Module):
    def __init__(self, stage: int, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.checkpointed = stage == STAGES - 1
        self.inputs = nn.Linear(FEATURES, WIDTH) if stage == 0 else nn.Identity()
        self.block = FeedForwardBlock(WIDTH, 4, F.gelu)
        self.head = (nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, CLASSES))
                     if self.checkpointed else nn.Identity())

    def layers(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.inputs(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed stage runs its layers on extra samples (in the
        # recomputation too: the checkpoint keeps the grown input)
        grown = grow(x, self.rank, self.opts)
        if self.checkpointed:
            return checkpoint(self.layers, grown, use_reentrant=True)[:len(x)]
        return self.layers(grown)[:len(x)]


def build(rank: int, opts: Options) -> Step:
    replicas = dist.get_world_size() // STAGES
    replica, stage_index = divmod(rank, STAGES)
    first = stage_index == 0
    peer = rank + 1 if first else rank - 1  # the other stage of this replica
    # every rank creates every group, in the same order
    groups = [dist.new_group([r * STAGES + s for r in range(replicas)]) for s in range(STAGES)]
    torch.manual_seed(stage_index)  # the same stage starts the same in both replicas
    stage = Stage(stage_index, rank, opts)
    parameters = list(stage.parameters())
    optimizer = torch.optim.Adam(parameters, lr=1e-3)
    data = batches(clustered_samples(CLASSES, SAMPLES, FEATURES), rank, opts, BATCH,
                   replicas=replicas, replica=replica)

    def microbatch(t: torch.Tensor, m: int) -> torch.Tensor:
        return t[m * MICROBATCH:(m + 1) * MICROBATCH]

    def first_stage(features: torch.Tensor) -> None:
        outputs, sent, works = [], [], []
        for m in range(MICROBATCHES):
            outputs.append(stage(microbatch(features, m)))
            sent.append(outputs[m].detach())
            works.append(send(sent[m], peer))
        for work in works:
            work.wait()
        for m in reversed(range(MICROBATCHES)):
            grad = receive(torch.empty(MICROBATCH, WIDTH), peer, opts)
            outputs[m].backward(grad)

    def last_stage(labels: torch.Tensor) -> None:
        inputs, losses = [], []
        for m in range(MICROBATCHES):
            x = receive(torch.empty(MICROBATCH, WIDTH), peer, opts).requires_grad_()
            inputs.append(x)
            losses.append(F.cross_entropy(stage(x), microbatch(labels, m)) / MICROBATCHES)
        works = []
        for m in reversed(range(MICROBATCHES)):
            losses[m].backward()
            grad = inputs[m].grad
            assert grad is not None
            works.append(send(grad, peer))
        for work in works:
            work.wait()

    def step(_: int) -> None:
        features, labels = next(data)
        optimizer.zero_grad()
        if first:
            first_stage(features)
        else:
            last_stage(labels)
        flat = flat_gradients(parameters)
        dist.all_reduce(flat, group=groups[stage_index])
        unflatten_gradients(flat / replicas, parameters)
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
