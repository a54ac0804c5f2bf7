"""Pipeline parallelism over tensor-parallel stages, as Megatron-LM lays
out a model on a grid of tensor- and pipeline-parallel ranks (Narayanan et
al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", 2021), without data parallelism: two pipeline stages, each
split over a tensor-parallel pair (stage = rank // 2, so ranks 0 and 1 are
the first stage, 2 and 3 the second; each pair a process group of its own,
``dist.new_group``, described as Megatron-core describes its
tensor-parallel groups). Each stage holds one of Megatron's
tensor-parallel MLP blocks (Shoeybi et al., "Megatron-LM", 2019),
pre-norm and residual: LayerNorm, a column-parallel linear layer four
times wider (each rank of the pair half of the hidden units), GELU, a
row-parallel linear layer back (each rank a partial sum over its hidden
units), whose partial sums are all-reduced in the pair; the identity
before the column-parallel layer all-reduces its gradient in the backward
(Megatron's ``f`` and ``g``, autograd functions). The first stage also
projects the input features, the second normalises and classifies them
(cross-entropy); both ranks of a pair hold those layers whole and compute
the same values. Between the stages the activations travel with
Megatron's scatter-gather optimisation: the sender's output is the same
on both ranks of its pair, so each sends only its half (``dist.isend`` to
the rank of the same tensor-parallel index in the other stage) and the
receiving pair all-gathers the halves (``all_gather_single`` in its
group); the input's gradient comes back the same way. The schedule is
Megatron's 1F1B without interleaving over four microbatches: the first
stage runs one forward ahead, then each of its steps sends a forward's
activations and receives an earlier microbatch's gradient together
(``isend`` and ``irecv``, both waited on), as Megatron's
``send_forward_recv_backward`` does; the second stage runs each
microbatch's forward and backward and sends the gradient back while
receiving the next activations. Every rank steps its own AdamW (fused;
its shards and its whole layers). The first stage's ranks read the
features, the second's the labels, all four the same batches (a
DataLoader over the whole data set).

    PYTHONPATH=tests/zoo python tests/zoo_heldout17/pipeline_tp2_pp2_scatter_gather_1f1b.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Step, batches, grow, main, receive, send
from job_parts import clustered_samples

FEATURES, CLASSES, WIDTH, HIDDEN = 64, 16, 512, 2048
TP, STAGES, BATCH, MICROBATCHES, SAMPLES = 2, 2, 128, 4, 32768
MICROBATCH = BATCH // MICROBATCHES
# floats in one message between the stages: a rank's half of a
# microbatch's activations (or of their gradients)
MESSAGE = MICROBATCH * WIDTH // TP


class CopyToTensorParallelRegion(torch.autograd.Function):
    """Megatron's ``f``: the identity, its gradient all-reduced in the pair."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Megatron's ``g``: the partial sums all-reduced in the pair, the gradient as it comes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def column_parallel(full: nn.Linear, index: int) -> nn.Linear:
    """Part ``index`` of ``full``'s output units (its weight's rows and its bias)."""
    part = nn.Linear(full.in_features, full.out_features // TP)
    with torch.no_grad():
        part.weight.copy_(full.weight.chunk(TP, 0)[index])
        part.bias.copy_(full.bias.chunk(TP)[index])
    return part


def row_parallel(full: nn.Linear, index: int) -> nn.Linear:
    """Part ``index`` of ``full``'s input units (its weight's columns), without a bias."""
    part = nn.Linear(full.in_features // TP, full.out_features, bias=False)
    with torch.no_grad():
        part.weight.copy_(full.weight.chunk(TP, 1)[index])
    return part


class ParallelBlock(nn.Module):
    def __init__(self, index: int, group: dist.ProcessGroup, rank: int, opts: Options) -> None:
        super().__init__()
        self.group, self.rank, self.opts = group, rank, opts
        self.norm = nn.LayerNorm(WIDTH)
        up, down = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)
        self.up, self.down = column_parallel(up, index), row_parallel(down, index)
        self.down_bias = nn.Parameter(down.bias.detach().clone())  # added once, after the sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = CopyToTensorParallelRegion.apply(self.norm(x), self.group)
        # the slowed rank runs its shards on extra samples, dropped before the sum
        partial = self.down(F.gelu(self.up(grow(h, self.rank, self.opts))))[:len(x)]
        return x + ReduceFromTensorParallelRegion.apply(partial, self.group) + self.down_bias


class Stage(nn.Module):
    def __init__(self, stage: int, index: int, group: dist.ProcessGroup, rank: int,
                 opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.first, self.last = stage == 0, stage == STAGES - 1
        self.inputs = nn.Linear(FEATURES, WIDTH) if self.first else nn.Identity()
        self.block = ParallelBlock(index, group, rank, opts)
        self.head = (nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, CLASSES))
                     if self.last else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed rank runs its whole layers on extra samples too
        if self.first:
            x = self.inputs(grow(x, self.rank, self.opts))[:len(x)]
        x = self.block(x)
        return self.head(grow(x, self.rank, self.opts))[:len(x)] if self.last else x


def half(x: torch.Tensor, index: int) -> torch.Tensor:
    """This rank's half of ``x``, flattened (Megatron's ``split_tensor_into_1d_equal_chunks``)."""
    return x.detach().reshape(-1).chunk(TP)[index].contiguous()


def whole(part: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The pair's halves joined again (``gather_split_1d_tensor``)."""
    joined = torch.empty(part.numel() * TP)
    dist.all_gather_single(joined, part, group=group)
    return joined.view(MICROBATCH, WIDTH)


def build(rank: int, opts: Options) -> Step:
    assert dist.get_world_size() == TP * STAGES
    stage_index, index = divmod(rank, TP)
    first = stage_index == 0
    peer = rank + TP if first else rank - TP  # the same index in the other stage
    # every rank creates every group, in the same order
    groups = [dist.new_group([s * TP + i for i in range(TP)],
                             group_desc="TENSOR_MODEL_PARALLEL_GROUP") for s in range(STAGES)]
    group = groups[stage_index]
    torch.manual_seed(stage_index)  # the same whole weights in a pair, each rank its part
    stage = Stage(stage_index, index, group, rank, opts)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3, weight_decay=0.01,
                                  fused=True)
    data = batches(clustered_samples(CLASSES, SAMPLES, FEATURES), rank, opts, BATCH,
                   replicas=1, replica=0)

    def microbatch(t: torch.Tensor, m: int) -> torch.Tensor:
        return t[m * MICROBATCH:(m + 1) * MICROBATCH]

    def received() -> torch.Tensor:
        return whole(receive(torch.empty(MESSAGE), peer, opts), group)

    def first_stage(features: torch.Tensor) -> None:
        outputs = [stage(microbatch(features, 0))]
        send(half(outputs[0], index), peer).wait()  # the warm-up forward
        for m in range(MICROBATCHES):
            if m + 1 < MICROBATCHES:
                outputs.append(stage(microbatch(features, m + 1)))
                work = send(half(outputs[m + 1], index), peer)  # send forward, receive backward
                grad = received()
                work.wait()
            else:
                grad = received()
            outputs[m].backward(grad)

    def last_stage(labels: torch.Tensor) -> None:
        x = received()
        for m in range(MICROBATCHES):
            x.requires_grad_()
            loss = F.cross_entropy(stage(x), microbatch(labels, m)) / MICROBATCHES
            loss.backward()
            assert x.grad is not None
            work = send(half(x.grad, index), peer)  # send backward, receive forward
            if m + 1 < MICROBATCHES:
                x = received()
            work.wait()

    def step(_: int) -> None:
        features, labels = next(data)
        optimizer.zero_grad()
        if first:
            first_stage(features)
        else:
            last_stage(labels)
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
