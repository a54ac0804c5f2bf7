"""A three-stage pipeline on ranks 1 to 3 fed by a fourth rank of its own,
rank 0, that reads the data and prepares it, all with the blocking
``dist.send`` and ``dist.recv`` of PyTorch's "Writing Distributed
Applications" tutorial, as jobs do that give their input pipeline (a
data loader and a frozen pretrained encoder, as when features are
extracted on the fly for a model trained on top of them) a process of
its own. Rank 0 reads each batch (a DataLoader over the whole data set),
runs it through the frozen encoder (an input layer and four pre-norm
residual feed-forward blocks, without gradients), sends the batch's
labels to the last stage (rank 3) and then each microbatch's features to
the first stage (rank 1); it computes no gradient and steps no optimizer,
and goes on to the next batch as soon as its sends are done. Ranks 1, 2
and 3 run GPipe's schedule (Huang et al., 2019) on four microbatches a
batch: all the forwards, each stage receiving a microbatch's activations
from the stage before and sending its own to the next, then all the
backwards in reverse order, each stage receiving the gradient of its
output from the next stage and sending its input's gradient to the stage
before (the first stage's inputs, the encoder's features, need none).
Each stage is a pre-norm residual feed-forward block (LayerNorm, a linear
layer four times wider, GELU, a linear layer back, the residual); the
last also normalises and classifies (cross-entropy, a quarter of it per
microbatch). Each stage steps its own Adam.

    PYTHONPATH=tests/zoo python tests/zoo_heldout16/pipeline_three_stage_loader_rank_send_recv.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Step, batches, grow, main
from job_parts import FeedForwardBlock, clustered_samples

FEATURES, CLASSES, WIDTH, ENCODER_BLOCKS = 64, 16, 256, 4
BATCH, MICROBATCHES, SAMPLES = 512, 4, 32768
MICROBATCH = BATCH // MICROBATCHES
LOADER, FIRST, LAST = 0, 1, 3
# floats in one message of the feed, the forward and the backward: a
# microbatch's features, activations or their gradients
MESSAGE = MICROBATCH * WIDTH
LABELS = BATCH  # int64 labels in one message from the loader to the last stage


class Encoder(nn.Module):
    """The loader's frozen encoder (random here, as a pretrained one would be loaded)."""

    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.inputs = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.Sequential(*(FeedForwardBlock(WIDTH, 4, F.gelu)
                                      for _ in range(ENCODER_BLOCKS)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a slowed loader encodes extra samples
        return self.blocks(self.inputs(grow(x, self.rank, self.opts)))[:len(x)]


class Stage(nn.Module):
    def __init__(self, last: bool, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.block = FeedForwardBlock(WIDTH, 4, F.gelu)
        self.head = (nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, CLASSES))
                     if last else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed stage runs its layers on extra samples
        return self.head(self.block(grow(x, self.rank, self.opts)))[:len(x)]


def loader(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    encoder = Encoder(rank, opts).requires_grad_(False).eval()
    data = batches(clustered_samples(CLASSES, SAMPLES, FEATURES), rank, opts, BATCH,
                   replicas=1, replica=0)

    def step(_: int) -> None:
        features, labels = next(data)
        with torch.no_grad():
            encoded = encoder(features)
        dist.send(labels, LAST)
        for m in range(MICROBATCHES):
            dist.send(encoded[m * MICROBATCH:(m + 1) * MICROBATCH].contiguous(), FIRST)
    return step


def stage(rank: int, opts: Options) -> Step:
    first, last = rank == FIRST, rank == LAST
    torch.manual_seed(rank)
    model = Stage(last, rank, opts)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    source = LOADER if first else rank - 1

    def step(_: int) -> None:
        optimizer.zero_grad()
        labels = torch.empty(BATCH, dtype=torch.long)
        if last:
            dist.recv(labels, LOADER)
        inputs, outputs = [], []
        for m in range(MICROBATCHES):
            x = torch.empty(MICROBATCH, WIDTH)
            dist.recv(x, source)
            inputs.append(x if first else x.requires_grad_())
            outputs.append(model(inputs[m]))
            if last:
                outputs[m] = F.cross_entropy(
                    outputs[m], labels[m * MICROBATCH:(m + 1) * MICROBATCH]) / MICROBATCHES
            else:
                dist.send(outputs[m].detach(), rank + 1)
        for m in reversed(range(MICROBATCHES)):
            if last:
                outputs[m].backward()
            else:
                grad = torch.empty(MICROBATCH, WIDTH)
                dist.recv(grad, rank + 1)
                outputs[m].backward(grad)
            if not first:
                input_grad = inputs[m].grad
                assert input_grad is not None
                dist.send(input_grad, rank - 1)
        optimizer.step()
    return step


def build(rank: int, opts: Options) -> Step:
    assert dist.get_world_size() == LAST + 1
    return loader(rank, opts) if rank == LOADER else stage(rank, opts)


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
