"""Ring attention (Liu et al., "Ring Attention with Blockwise Transformers
for Near-Infinite Context", 2023), written with the non-blocking
point-to-point of PyTorch's "Writing Distributed Applications" tutorial
(``dist.isend`` and ``dist.irecv``) after its Context Parallel tutorial,
whose ring attention is torch's own for GPUs: every rank holds a quarter
of each sequence (its own consecutive tokens; every rank reads the same
sequences) and the whole model. In each attention layer a rank computes
its quarter's queries, keys and values; the keys and values (stacked,
one message) then travel round the ring in three steps, each rank
sending the block it holds to rank + 1 and receiving rank - 1's while it
attends to the block it has (the send and receive posted before the
block's attention, waited on after it). Each block's attention is folded
into the output with a running log-sum-exp (blockwise, as FlashAttention
does: no rank ever holds all the scores). The backward is written by
hand as the paper's: the keys and values go round the ring again, the
same way, and with them the gradients of each block's keys and values,
to which every rank adds its own queries' share before it passes them
on; a fourth pass brings each block's gradients home. The model is a
masked language model after BERT (Devlin et al., 2019): token embeddings
and learned positions, one block (to keep the job small) of pre-norm
(full, not causal) attention and a pre-norm feed-forward layer, a final
LayerNorm and the head, trained to restore the tokens that 15% of the
positions had replaced by a mask token; the loss is each rank's over its
own masked positions. The projections' and every other weight's
gradients (the weights are replicated) are averaged with one
``all_reduce`` of them all, flattened; AdamW (fused).

    PYTHONPATH=tests/zoo python tests/zoo_heldout14/ring_attention_isend_irecv.py --out DIR
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Rows, Step, batches, grow, main, send
from job_parts import FeedForwardBlock, flat_gradients, markov_sequences, unflatten_gradients

VOCAB, MODEL, HEADS, LAYERS = 512, 128, 4, 1
CHUNK, BATCH, SEQUENCES, MASKED = 64, 8, 2048, 0.15  # CHUNK: tokens per rank
MASK = VOCAB  # the mask token's id
# floats in one message: a block's keys and values, stacked (or their gradients)
MESSAGE = 2 * BATCH * CHUNK * MODEL


def passed_on(block: torch.Tensor, opts: Options) -> Callable[[], torch.Tensor]:
    """Send ``block`` to rank + 1 and post the receive of rank - 1's; the
    returned wait gives the block received."""
    rank, world = dist.get_rank(), dist.get_world_size()
    left = (rank - 1) % world
    received = torch.empty_like(block)
    sent = send(block.contiguous(), (rank + 1) % world)
    receiving = dist.irecv(received, src=left)
    assert receiving is not None

    def wait() -> torch.Tensor:
        delay = opts.link_delay_s(rank, left)  # --slow-link: the receiver sleeps first
        if delay:
            time.sleep(delay)
        receiving.wait()
        sent.wait()
        return received
    return wait


class RingAttention(torch.autograd.Function):
    """Attention from this rank's queries (batch, heads, queries, dim) to
    every rank's keys and values, a block a step round the ring."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                opts: Options) -> torch.Tensor:
        world, scale = dist.get_world_size(), q.shape[-1] ** -0.5
        block = torch.stack([k, v])
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"))
        for hop in range(world):
            wait = passed_on(block, opts) if hop + 1 < world else None
            scores = torch.matmul(q, block[0].transpose(-2, -1)) * scale
            block_lse = torch.logsumexp(scores, -1)
            block_out = torch.matmul(torch.exp(scores - block_lse[..., None]), block[1])
            merged = torch.logaddexp(lse, block_lse)
            out = (torch.exp(lse - merged)[..., None] * out
                   + torch.exp(block_lse - merged)[..., None] * block_out)
            lse = merged
            if wait:
                block = wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.opts = opts
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                         torch.Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        world, scale = dist.get_world_size(), q.shape[-1] ** -0.5
        delta = (grad * out).sum(-1, keepdim=True)
        block, block_grads = torch.stack([k, v]), None
        q_grad = torch.zeros_like(q)
        for hop in range(world):
            wait = passed_on(block, ctx.opts) if hop + 1 < world else None
            weights = torch.exp(torch.matmul(q, block[0].transpose(-2, -1)) * scale
                                - lse[..., None])
            scores_grad = weights * (torch.matmul(grad, block[1].transpose(-2, -1)) - delta)
            q_grad += torch.matmul(scores_grad, block[0]) * scale
            own = torch.stack([torch.matmul(scores_grad.transpose(-2, -1), q) * scale,
                               torch.matmul(weights.transpose(-2, -1), grad)])
            block_grads = own if block_grads is None else block_grads + own
            if wait:
                block = wait()
            # the block's gradients follow it to rank + 1; after the last
            # step they reach the rank whose block it is
            block_grads = passed_on(block_grads, ctx.opts)()
        assert block_grads is not None
        return q_grad, block_grads[0], block_grads[1], None


class Block(nn.Module):
    """Pre-norm attention round the ring, then a pre-norm feed-forward layer."""

    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.norm = nn.LayerNorm(MODEL)
        self.qkv, self.projection = nn.Linear(MODEL, 3 * MODEL), nn.Linear(MODEL, MODEL)
        self.feedforward = FeedForwardBlock(MODEL, 4, F.gelu)

    def grown(self, x: torch.Tensor) -> torch.Tensor:
        return grow(x, self.rank, self.opts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed rank projects extra sequences, attends from extra
        # queries (rows of (queries, heads, batch, dim)) and runs extra
        # sequences through the feed-forward layer
        heads = self.qkv(self.grown(self.norm(x)))[:len(x)].unflatten(-1, (3, HEADS, -1))
        q, k, v = heads.permute(2, 0, 3, 1, 4)  # each (batch, heads, tokens, dim)
        more = self.grown(q.transpose(0, 2)).transpose(0, 2)
        out = RingAttention.apply(more.contiguous(), k.contiguous(), v.contiguous(),
                                  self.opts)[:, :, :x.shape[1]]
        x = x + self.projection(out.transpose(1, 2).flatten(2))
        return self.feedforward(self.grown(x))[:len(x)]


class MaskedLanguageModel(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank = rank
        self.embedding = nn.Embedding(VOCAB + 1, MODEL)
        self.positions = nn.Parameter(0.02 * torch.randn(opts.world * CHUNK, MODEL))
        self.blocks = nn.Sequential(*(Block(rank, opts) for _ in range(LAYERS)))
        self.norm, self.head = nn.LayerNorm(MODEL), nn.Linear(MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        start = self.rank * CHUNK
        x = self.embedding(tokens) + self.positions[start:start + CHUNK]
        return self.head(self.norm(self.blocks(x)))


def masked(length: int) -> Rows:
    """Sequences of a Markov chain with 15% of their tokens replaced by the
    mask token, and the tokens to restore (-100 where none was masked)."""
    tokens = markov_sequences(VOCAB, SEQUENCES, length).tensors[0]
    hidden = torch.rand(tokens.shape, generator=torch.Generator().manual_seed(1)) < MASKED
    return Rows(torch.where(hidden, MASK, tokens), torch.where(hidden, tokens, -100))


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)  # every rank starts from the same parameters
    model = MaskedLanguageModel(rank, opts)
    parameters = list(model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    # the sequence is split, not the batch: every rank reads the same sequences
    data = batches(masked(opts.world * CHUNK), rank, opts, BATCH, replicas=1, replica=0)
    own = slice(rank * CHUNK, (rank + 1) * CHUNK)

    def step(_: int) -> None:
        tokens, targets = next(data)
        optimizer.zero_grad()
        logits = model(tokens[:, own])
        F.cross_entropy(logits.flatten(0, 1), targets[:, own].flatten()).backward()
        flat = flat_gradients(parameters)
        dist.all_reduce(flat)
        unflatten_gradients(flat / opts.world, parameters)
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
