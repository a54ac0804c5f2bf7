"""Low-rank adaptation (Hu et al., "LoRA: Low-Rank Adaptation of Large
Language Models", 2021) of a frozen base model sharded with FSDP2
(``torch.distributed.fsdp.fully_shard``) as PyTorch's torchtune shards
its LoRA fine-tuning, one unit per block with the block's frozen weights
and trainable adapters together: a stack of pre-norm residual MLP blocks
(LayerNorm, a linear layer four times wider, GELU, a linear layer back)
between an input projection and a classifier, whose base weights (every
linear layer's weight and bias, the LayerNorms) are frozen
(``requires_grad`` False) and stand for a pretrained model, with a
trainable adapter of rank 8 on each linear layer (``x A^T B^T`` scaled
by alpha / rank = 2, added to the frozen layer's output; A initialised
as PEFT initialises it, B at zero). ``fully_shard`` on each block and on
the whole model: a unit's parameters, frozen and trainable, are
all-gathered before its forward and again before its backward, and only
the adapters' gradients are reduce-scattered (the frozen weights have
none). AdamW (fused) steps the adapters' shards only. Each rank reads
its share of the samples (a DataLoader with a DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout14/fsdp2_lora_frozen_base.py --out DIR
"""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from launch import Options, Step, batches, grow, main, train_step
from job_parts import clustered_samples

FEATURES, CLASSES, WIDTH, BLOCKS = 64, 16, 128, 2
LORA_RANK, LORA_ALPHA = 8, 16
BATCH, SAMPLES = 128, 16384


class LoRALinear(nn.Module):
    """A frozen linear layer with a trainable low-rank update."""

    def __init__(self, features: int, outputs: int) -> None:
        super().__init__()
        self.base = nn.Linear(features, outputs).requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(LORA_RANK, features))
        self.lora_b = nn.Parameter(torch.zeros(outputs, LORA_RANK))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scaling = LORA_ALPHA / LORA_RANK

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scaling


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH).requires_grad_(False)
        self.up, self.down = LoRALinear(WIDTH, 4 * WIDTH), LoRALinear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Classifier(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.inputs = LoRALinear(FEATURES, WIDTH)
        self.blocks = nn.Sequential(*(Block() for _ in range(BLOCKS)))
        self.norm = nn.LayerNorm(WIDTH).requires_grad_(False)
        self.head = LoRALinear(WIDTH, CLASSES)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # the slowed rank runs its blocks on extra samples (dropped before
        # the head: a sliced output of an FSDP unit is a view)
        x = self.blocks(self.inputs(grow(features, self.rank, self.opts)))
        return self.head(self.norm(x[:len(features)]))


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)  # the same base and adapters everywhere, each rank its shards
    model = Classifier(rank, opts)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    adapters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(adapters, lr=1e-3, weight_decay=0.01, fused=True)
    data = batches(clustered_samples(CLASSES, SAMPLES, FEATURES), rank, opts, BATCH)

    def step(_: int) -> None:
        features, labels = next(data)
        train_step(lambda: F.cross_entropy(model(features), labels), optimizer, opts)
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
