"""Sequence parallel attention as DeepSpeed-Ulysses does it (Jacobs et al.,
"DeepSpeed Ulysses", 2023), on a small Transformer language model: every
rank reads the same sequences (a DataLoader over the whole data set) and
keeps a quarter of each, its own consecutive tokens. Each rank embeds its
tokens (token and position embeddings) and projects its queries, keys
and values; before the attention an ``all_to_all_single`` turns the
sequence shards into head shards (each rank then holds the whole
sequence for two of the eight heads and runs causal attention on it),
after the attention another turns them back into sequence shards for the
output projection, the MLP, the final LayerNorm and the language-model
head. The all-to-all is an autograd function whose backward is the
reverse all-to-all. Each rank's loss is the mean cross-entropy of its
own tokens; every weight is replicated, so its gradients are averaged
over the ranks (``all_reduce``) before Adam steps.

    PYTHONPATH=tests/zoo python tests/zoo_heldout11/ulysses_sequence_parallel.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Rows, Step, average_gradients, batches, grow, main
from job_parts import markov_sequences

VOCAB, CONTEXT, WIDTH, HEADS = 512, 128, 128, 8
BATCH, SEQUENCES = 16, 2048


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """``x`` cut into one piece per rank along ``scatter_dim``, rank j sent
    the j-th; what the ranks sent back joined along ``gather_dim`` in rank
    order."""
    pieces = torch.stack(x.chunk(dist.get_world_size(), dim=scatter_dim)).contiguous()
    received = torch.empty_like(pieces)
    dist.all_to_all_single(received, pieces)
    return torch.cat(received.unbind(0), dim=gather_dim)


class SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.dims = scatter_dim, gather_dim
        return all_to_all(x, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return all_to_all(grad, gather_dim, scatter_dim), None, None


class UlyssesAttention(nn.Module):
    """Causal self-attention of a sequence shard ([batch, tokens, width])."""

    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.out = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # the slowed rank projects and attends over extra sequences too
        qkv = self.qkv(grow(x, self.rank, self.opts))[:batch]
        # [batch, tokens, heads, head width]: sequence shards to head shards
        q, k, v = (SeqAllToAll.apply(t.view(batch, tokens, HEADS, -1), 2, 1)
                   for t in qkv.chunk(3, dim=-1))
        q, k, v = (grow(t.transpose(1, 2), self.rank, self.opts) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:batch].transpose(1, 2)
        y = SeqAllToAll.apply(y, 1, 2).reshape(batch, tokens, WIDTH)
        return self.out(grow(y, self.rank, self.opts))[:batch]


class LanguageModel(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.norm1, self.attention = nn.LayerNorm(WIDTH), UlyssesAttention(rank, opts)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH))
        self.norm3, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, first: int) -> torch.Tensor:
        """The logits of a shard of sequences that starts at position ``first``."""
        x = self.tokens(tokens) + self.positions(torch.arange(first, first + tokens.shape[1]))
        x = x + self.attention(self.norm1(x))
        x = x + self.mlp(self.norm2(grow(x, self.rank, self.opts)))[:len(x)]
        return self.head(self.norm3(x))


def sequences() -> Rows:
    return markov_sequences(VOCAB, SEQUENCES, CONTEXT)


def build(rank: int, opts: Options) -> Step:
    shard = CONTEXT // dist.get_world_size()
    first = rank * shard
    torch.manual_seed(0)  # every rank holds the same weights
    model = LanguageModel(rank, opts)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    # every rank reads the same sequences and keeps its own tokens of them
    data = batches(sequences(), rank, opts, BATCH, replicas=1, replica=0)

    def step(_: int) -> None:
        tokens, targets = (t[:, first:first + shard] for t in next(data))
        optimizer.zero_grad()
        F.cross_entropy(model(tokens, first).flatten(0, 1), targets.flatten()).backward()
        average_gradients(model.parameters())
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
