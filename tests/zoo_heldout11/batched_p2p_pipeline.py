"""A four-stage GPipe pipeline (Huang et al., 2019) whose point-to-point
is written with ``dist.batch_isend_irecv``, as Megatron-LM's
``p2p_communication`` batches its sends and receives: rank r is stage r.
All microbatches go forward, then all backward. Each stage hands a
microbatch's activations to the next stage and receives the next
microbatch's from the stage before in one batch of ``P2POp``s (a send to
the next rank and a receive from the previous, both waited on); backward
does the same the other way with the gradients of the activations. Each
stage is a pre-norm feed-forward block (LayerNorm, a linear layer four
times wider, GELU, a linear layer back, the residual); the first stage
also projects the input features, the last normalises and classifies them
(cross-entropy, a quarter of it per microbatch). Every stage steps AdamW
on its own parameters. The first and the last stage read the same
batches (a DataLoader over the whole data set): the first the features,
the last the labels.

    PYTHONPATH=tests/zoo python tests/zoo_heldout11/batched_p2p_pipeline.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Rows, Step, batches, grow, main
from job_parts import clustered_samples

FEATURES, CLASSES, WIDTH = 64, 16, 256
BATCH, MICROBATCHES, SAMPLES = 256, 4, 8192
MICROBATCH = BATCH // MICROBATCHES
# floats in one message: a microbatch's activations (or their gradients)
MESSAGE = MICROBATCH * WIDTH


class Stage(nn.Module):
    def __init__(self, stage: int, stages: int, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.inputs = nn.Linear(FEATURES, WIDTH) if stage == 0 else nn.Identity()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.head = (nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, CLASSES))
                     if stage == stages - 1 else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed stage runs its layers on extra samples
        h = self.inputs(grow(x, self.rank, self.opts))
        h = h + self.down(F.gelu(self.up(self.norm(h))))
        return self.head(h)[:len(x)]


def exchange(sends: list[tuple[torch.Tensor, int]],
             receives: list[tuple[torch.Tensor, int]]) -> None:
    """Send and receive in one ``batch_isend_irecv``, then wait for all of it."""
    ops = ([dist.P2POp(dist.isend, tensor, peer) for tensor, peer in sends]
           + [dist.P2POp(dist.irecv, tensor, peer) for tensor, peer in receives])
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def build(rank: int, opts: Options) -> Step:
    stages = dist.get_world_size()
    first, last = rank == 0, rank == stages - 1
    previous, following = rank - 1, rank + 1
    torch.manual_seed(rank)
    stage = Stage(rank, stages, rank, opts)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3, weight_decay=0.01)
    data = (batches(clustered_samples(CLASSES, SAMPLES, FEATURES), rank, opts, BATCH,
                    replicas=1, replica=0) if first or last else None)

    def forward(features: torch.Tensor | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        inputs, outputs, pending = [], [], []
        for m in range(MICROBATCHES):
            if features is not None:
                x = features[m * MICROBATCH:(m + 1) * MICROBATCH]
                exchange(pending, [])
            else:
                x = torch.empty(MICROBATCH, WIDTH)
                exchange(pending, [(x, previous)])
                x.requires_grad_()
            y = stage(x)
            inputs.append(x)
            outputs.append(y)
            pending = [] if last else [(y.detach(), following)]
        exchange(pending, [])
        return inputs, outputs

    def backward(inputs: list[torch.Tensor], outputs: list[torch.Tensor],
                 labels: torch.Tensor | None) -> None:
        pending: list[tuple[torch.Tensor, int]] = []
        for m, (x, y) in enumerate(zip(inputs, outputs)):
            if labels is not None:
                exchange(pending, [])
                loss = F.cross_entropy(y, labels[m * MICROBATCH:(m + 1) * MICROBATCH])
                (loss / MICROBATCHES).backward()
            else:
                grad = torch.empty(MICROBATCH, WIDTH)
                exchange(pending, [(grad, following)])
                y.backward(grad)
            pending = [] if first else [(x.grad, previous)]
        exchange(pending, [])

    def step(_: int) -> None:
        features, labels = next(data) if data is not None else (None, None)
        optimizer.zero_grad()
        inputs, outputs = forward(features if first else None)
        backward(inputs, outputs, labels if last else None)
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
