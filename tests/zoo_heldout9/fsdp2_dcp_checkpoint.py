"""FSDP2 with a distributed checkpoint every step, as PyTorch's "Getting
Started with Distributed Checkpoint (DCP)" and "Asynchronous Saving with
DCP" recipes set it up: ``fully_shard`` on the residual block of an MLP
classifier and on the whole model (a unit's parameters all-gathered before
its forward and backward, its gradients reduce-scattered), AdamW (fused)
on the shards, and after each optimizer step the sharded model and
optimizer state (``get_state_dict``, wrapped in a ``Stateful`` as the
recipe's ``AppState``) saved with ``torch.distributed.checkpoint.async_save``
into a folder of its own per step. Each rank stages its shards and writes
its own file in a background thread while training goes on; the
coordinator (rank 0) gathers the ranks' save plans and writes the
metadata; a save waits for the one before it to finish, as the recipe
does, and on a process group of its own (gloo) so its collectives do not
interleave with the training's. Feature vectors a DataLoader reads with a
DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout9/fsdp2_dcp_checkpoint.py --out DIR
"""
from __future__ import annotations

import sys
import tempfile
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

from launch import Options, Rows, Step, batches, grow, main

FEATURES, CLASSES, WIDTH = 64, 16, 256
BATCH, SAMPLES = 64, 4096
# the checkpoints' folder: made by the launching process before it forks the
# ranks (so they share it) and removed when they are done
FOLDER = ""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(WIDTH), nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Classifier(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.inputs = nn.Linear(FEATURES, WIDTH)
        self.block = Block()
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # the slowed rank classifies extra samples
        x = self.inputs(grow(features, self.rank, self.opts))
        x = self.block(x)
        return self.head(x[:len(features)])


class AppState(Stateful):
    """The model and optimizer state as DCP saves it (the recipe's wrapper:
    ``get_state_dict`` gives each rank its shards, as DTensors)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optimizer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def samples() -> Rows:
    """Feature vectors around one of a few centres per class, and their classes."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(CLASSES, 4, FEATURES, generator=g)
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    which = torch.randint(0, 4, (SAMPLES,), generator=g)
    return Rows(centres[labels, which] + 0.5 * torch.randn(SAMPLES, FEATURES, generator=g),
                labels)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = Classifier(rank, opts)
    fully_shard(model.block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    data = batches(samples(), rank, opts, BATCH)
    # the recipe's advice: the checkpoint's collectives on a gloo group of their own
    saving = dist.new_group(backend="gloo")
    pending: list[Future[Any]] = []

    def step(i: int) -> None:
        features, labels = next(data)
        optimizer.zero_grad()
        F.cross_entropy(model(features), labels).backward()
        optimizer.step()
        if pending:  # one save in flight at a time
            pending.pop().result()
        state = {"app": AppState(model, optimizer)}
        saved = dcp.async_save(state, checkpoint_id=f"{FOLDER}/step-{i}", process_group=saving)
        # (a response of two futures comes back only with a zero-overhead stager)
        assert isinstance(saved, Future)
        pending.append(saved)
    return step


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="fsdp2-dcp-") as FOLDER:
        sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
