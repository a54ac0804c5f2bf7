"""Two data-parallel replicas of a two-stage pipeline with a hand-written
one-forward-one-backward (1F1B) schedule whose activations and gradients
move by blocking ``dist.send`` and ``dist.recv``: rank = 2 x replica +
stage, so ranks 0 -> 1 and 2 -> 3 are the pipelines. Four microbatches a
batch; the first stage runs one microbatch ahead (after the first
forward, each step receives a microbatch's gradients, sends the next
microbatch's activations, runs that backward, then the next forward), the
last stage runs each microbatch's forward and backward in turn. Each
stage is a pre-norm feed-forward block (LayerNorm, a linear layer four
times wider, GELU, a linear layer back, the residual); the first stage
also projects the input features, the last normalises and classifies
them. After the schedule each stage's gradients are averaged with the
same stage of the other replica (``all_reduce`` in a group of the two),
then AdamW. Both stages of a replica read its batches (a DataLoader over
its half of the samples): the first the features, the last the labels.

    PYTHONPATH=tests/zoo python tests/zoo_heldout12/pipeline_1f1b_send_recv_two_stage_dp2.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Step, average_gradients, batches, grow, main
from job_parts import FeedForwardBlock, clustered_samples

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
        self.inputs = nn.Linear(FEATURES, WIDTH) if stage == 0 else nn.Identity()
        self.block = FeedForwardBlock(WIDTH, 4, F.gelu)
        self.head = (nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, CLASSES))
                     if stage == STAGES - 1 else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed stage runs its layers on extra samples
        return self.head(self.block(self.inputs(grow(x, self.rank, self.opts))))[:len(x)]


def build(rank: int, opts: Options) -> Step:
    replicas = dist.get_world_size() // STAGES
    replica, stage_index = divmod(rank, STAGES)
    first = stage_index == 0
    peer = rank + 1 if first else rank - 1  # the other stage of this replica
    # every rank creates every group, in the same order
    groups = [dist.new_group([r * STAGES + s for r in range(replicas)]) for s in range(STAGES)]
    torch.manual_seed(stage_index)  # the same stage starts the same in both replicas
    stage = Stage(stage_index, rank, opts)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3, weight_decay=0.01)
    data = batches(clustered_samples(CLASSES, SAMPLES, FEATURES), rank, opts, BATCH,
                   replicas=replicas, replica=replica)

    def microbatch(t: torch.Tensor, m: int) -> torch.Tensor:
        return t[m * MICROBATCH:(m + 1) * MICROBATCH]

    def first_stage(features: torch.Tensor) -> None:
        outputs = [stage(microbatch(features, 0))]
        dist.send(outputs[0].detach(), peer)
        for m in range(MICROBATCHES):
            if m + 1 < MICROBATCHES:
                outputs.append(stage(microbatch(features, m + 1)))
            grad = torch.empty(MICROBATCH, WIDTH)
            dist.recv(grad, peer)
            if m + 1 < MICROBATCHES:
                dist.send(outputs[m + 1].detach(), peer)
            outputs[m].backward(grad)

    def last_stage(labels: torch.Tensor) -> None:
        for m in range(MICROBATCHES):
            x = torch.empty(MICROBATCH, WIDTH)
            dist.recv(x, peer)
            x.requires_grad_()
            loss = F.cross_entropy(stage(x), microbatch(labels, m))
            (loss / MICROBATCHES).backward()
            dist.send(x.grad, peer)

    def step(_: int) -> None:
        features, labels = next(data)
        optimizer.zero_grad()
        if first:
            first_stage(features)
        else:
            last_stage(labels)
        average_gradients(stage.parameters(), groups[stage_index])
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
