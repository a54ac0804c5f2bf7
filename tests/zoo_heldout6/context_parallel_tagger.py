"""Context (sequence) parallelism with the keys and values passed round a
ring, written with the point-to-point sends of PyTorch's "Writing
Distributed Applications" tutorial after its Context Parallel tutorial
(there torch's own ring attention, for GPUs): every rank holds a quarter of
each long document (a contiguous chunk of its tokens; every rank reads the
same documents) and the whole model. In the attention each rank computes
its chunk's queries, keys and values; the keys and values (stacked, one
message) then travel round the ring, each rank sending what it holds to its
right-hand neighbour and receiving its left-hand neighbour's, world-1
times, and each rank scores its queries against every block as it arrives;
one softmax over all the scores then weights all the values (full, not
causal, attention). In backward the blocks' gradients travel back round the
ring the other way (an autograd function). The model tags every token (a
token-classification transformer: embeddings and learned positions,
pre-norm blocks of self-attention and a feed-forward layer, one, to keep
the job small, and a linear tagger), cross-entropy over the rank's tokens;
the gradients are then averaged with one ``all_reduce`` of them all,
flattened; SGD with momentum (fused).

    PYTHONPATH=tests/zoo python tests/zoo_heldout6/context_parallel_tagger.py --out DIR
"""
from __future__ import annotations

import math
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Rows, Step, batches, grow, main, receive, send

VOCAB, TAGS, MODEL, HEADS, LAYERS, BATCH, DOCUMENTS = 1000, 8, 128, 4, 1, 4, 512
CHUNK = 64  # tokens per rank: a document is world x CHUNK tokens
MESSAGE = 2 * BATCH * CHUNK * MODEL  # floats in one message: a chunk's keys and values


def exchange(tensor: torch.Tensor, to: int, source: int, opts: Options) -> torch.Tensor:
    """Send ``tensor`` to rank ``to`` and receive its like from ``source``."""
    sent = send(tensor.contiguous(), to)
    received = receive(torch.empty_like(tensor), source, opts)
    sent.wait()
    return received


class RingPass(torch.autograd.Function):
    """Forward: pass a block to the right-hand neighbour and take the
    left-hand one's; backward: the gradients go the other way."""

    @staticmethod
    def forward(ctx: Any, block: torch.Tensor, opts: Options) -> torch.Tensor:
        rank, world = dist.get_rank(), dist.get_world_size()
        ctx.opts, ctx.right, ctx.left = opts, (rank + 1) % world, (rank - 1) % world
        return exchange(block, ctx.right, ctx.left, opts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return exchange(grad, ctx.left, ctx.right, ctx.opts), None


def ring_attention(q: torch.Tensor, keys_values: torch.Tensor, opts: Options) -> torch.Tensor:
    """Attention from ``q`` (batch, heads, queries, dim) to every rank's
    keys and values, one block per hop round the ring."""
    scores, values = [], []
    for hop in range(dist.get_world_size()):
        if hop:
            keys_values = RingPass.apply(keys_values, opts)
        k, v = keys_values
        scores.append(q @ k.transpose(-2, -1))
        values.append(v)
    weights = torch.softmax(torch.cat(scores, -1) / math.sqrt(q.shape[-1]), -1)
    return weights @ torch.cat(values, -2)


class Block(nn.Module):
    """Pre-norm self-attention (round the ring) and a feed-forward layer."""

    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.norm1, self.norm2 = nn.LayerNorm(MODEL), nn.LayerNorm(MODEL)
        self.qkv, self.projection = nn.Linear(MODEL, 3 * MODEL), nn.Linear(MODEL, MODEL)
        self.feedforward = nn.Sequential(nn.Linear(MODEL, 4 * MODEL), nn.GELU(),
                                         nn.Linear(4 * MODEL, MODEL))

    def grown(self, x: torch.Tensor) -> torch.Tensor:
        return grow(x, self.rank, self.opts)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        heads = self.qkv(self.grown(x))[:len(x)].unflatten(-1, (3, HEADS, -1))
        q, k, v = heads.permute(2, 0, 3, 1, 4)  # each (batch, heads, tokens, dim)
        # the slowed rank attends from extra queries (rows of (tokens, heads, batch, dim))
        more = self.grown(q.transpose(0, 2)).transpose(0, 2)
        out = ring_attention(more, torch.stack([k, v]), self.opts)[:, :, :x.shape[1]]
        return self.projection(out.transpose(1, 2).flatten(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        # the slowed rank runs extra chunks through the feed-forward layer
        return x + self.feedforward(self.grown(self.norm2(x)))[:len(x)]


class Tagger(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank = rank
        self.embedding = nn.Embedding(VOCAB, MODEL)
        self.positions = nn.Parameter(0.02 * torch.randn(opts.world * CHUNK, MODEL))
        self.blocks = nn.Sequential(*(Block(rank, opts) for _ in range(LAYERS)))
        self.norm, self.tagger = nn.LayerNorm(MODEL), nn.Linear(MODEL, TAGS)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        start = self.rank * CHUNK
        x = self.embedding(tokens) + self.positions[start:start + CHUNK]
        return self.tagger(self.norm(self.blocks(x)))


def average_gradients(model: nn.Module) -> None:
    """One all-reduce of every gradient, flattened, then the mean."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for grad, averaged in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(averaged.view_as(grad))


def documents() -> Rows:
    """Random documents, each with a topic: the tag of a token is its
    word's class shifted by the topic, which a few of its words (anywhere
    in the document) give away."""
    g = torch.Generator().manual_seed(0)
    length = dist.get_world_size() * CHUNK
    topics = torch.randint(0, TAGS, (DOCUMENTS, 1), generator=g)
    words = torch.randint(TAGS, VOCAB, (DOCUMENTS, length), generator=g)
    telling = torch.rand(DOCUMENTS, length, generator=g) < 0.02
    words = torch.where(telling, topics.expand(-1, length), words)  # ids below TAGS: topics
    return Rows(words, (words + topics) % TAGS)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)  # every rank starts from the same parameters
    model = Tagger(rank, opts)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
    # the sequence is split, not the batch: every rank reads the same documents
    data = batches(documents(), rank, opts, BATCH, replicas=1, replica=0)
    own = slice(rank * CHUNK, (rank + 1) * CHUNK)

    def step(_: int) -> None:
        words, tags = next(data)
        optimizer.zero_grad()
        logits = model(words[:, own])
        F.cross_entropy(logits.flatten(0, 1), tags[:, own].flatten()).backward()
        average_gradients(model)
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
