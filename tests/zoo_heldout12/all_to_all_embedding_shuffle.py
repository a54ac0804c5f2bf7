"""A row-sharded embedding table whose lookups are routed to the rank that
owns each row with ``all_to_all_single``, as recommendation models shard
their tables: each rank owns a quarter of the table's rows. A rank sorts
its batch's token ids by owner, tells every rank how many it will send
(an ``all_to_all_single`` of the counts), sends them (uneven splits),
looks up the ids it received in its own quarter and sends the vectors
back the same way (``torch.distributed.nn.functional.all_to_all_single``,
whose backward sends the gradients the reverse way to the rows' owner).
The vectors of a window of tokens, averaged, go through a dense head (two
linear layers) under DistributedDataParallel, which averages its
gradients; the owner's SGD steps its quarter of the table. The target is
the token after the window (a Markov chain's), each rank reading its
share of the windows.

    PYTHONPATH=tests/zoo python tests/zoo_heldout12/all_to_all_embedding_shuffle.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from launch import Options, Rows, Step, batches, grow, main, train_step
from job_parts import markov_sequences

VOCAB, WINDOW, DIM, HIDDEN = 4096, 16, 128, 512
BATCH, SEQUENCES = 128, 16384


class DenseHead(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.layers = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, VOCAB))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed rank runs its layers on extra rows
        return self.layers(grow(x, self.rank, self.opts))[:len(x)]


def windows() -> Rows:
    tokens, following = markov_sequences(VOCAB, SEQUENCES, WINDOW).tensors
    return Rows(tokens, following[:, -1].contiguous())


def build(rank: int, opts: Options) -> Step:
    world = dist.get_world_size()
    shard = VOCAB // world
    torch.manual_seed(rank)
    table = nn.Embedding(shard, DIM)  # rows rank * shard to (rank + 1) * shard
    torch.manual_seed(0)
    head = DDP(DenseHead(rank, opts))
    optimizer = torch.optim.SGD([*table.parameters(), *head.parameters()], lr=0.05,
                                momentum=0.9)
    data = batches(windows(), rank, opts, BATCH)

    def lookup(ids: torch.Tensor) -> torch.Tensor:
        owner = ids // shard
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=world)
        receive_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(receive_counts, send_counts)
        sends, receives = send_counts.tolist(), receive_counts.tolist()
        asked = torch.empty(sum(receives), dtype=ids.dtype)
        dist.all_to_all_single(asked, ids[order], receives, sends)
        found = table(asked - rank * shard)
        vectors = dist_fn.all_to_all_single(torch.empty(len(ids), DIM), found, sends, receives)
        return torch.empty_like(vectors).index_copy(0, order, vectors)

    def step(_: int) -> None:
        window, following = next(data)

        def loss() -> torch.Tensor:
            vectors = lookup(window.flatten()).view(len(window), WINDOW, DIM).mean(1)
            return F.cross_entropy(head(vectors), following)
        train_step(loss, optimizer, opts)
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
