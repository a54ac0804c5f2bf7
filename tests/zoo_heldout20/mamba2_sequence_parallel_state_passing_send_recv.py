"""Sequence parallelism for a state space model, as the Mamba-2 paper
splits a long sequence over devices (Dao and Gu, "Transformers are SSMs:
Generalized Models and Efficient Algorithms Through Structured State Space
Duality", 2024, section 8: each device computes its chunk's outputs and
final state as if the state before it were zero, then the states are
passed from device to device and each corrects its outputs by the state
it received). A small Mamba-2 language model: token embeddings, two
pre-norm residual Mamba-2 blocks (RMSNorm; an input projection to the
gate, the inputs of 4 heads of 32 channels, a shared B and C of state
size 8 and each head's step size; the selective state space layer of the
paper's minimal SSD reference, ``ssd_minimal_discrete``, its decays from
a learned A and the softplus of the step; a skip D, the SiLU gate and an
output projection; without the short convolution), a final RMSNorm and
the vocabulary's logits (cross-entropy on the next token). Every rank
reads the same sequences (a DataLoader over the whole data set) and keeps
a quarter of each, its own consecutive 32 tokens. In each block every
rank first computes its chunk's outputs from within the chunk (the
quadratic, attention-like form: C B^T masked by the decays, times the
inputs) and its chunk's own final state; then rank r receives the state
before its chunk from rank r - 1 (zero on rank 0), adds it, decayed, to
its final state and sends that on to rank r + 1 (``dist.isend`` and
``dist.irecv``, the point-to-point of PyTorch's "Writing Distributed
Applications" tutorial), and adds to its outputs the received state read
out by C. In the backward the states' gradients go the other way, rank 3
first: each rank runs its backward from its own loss and from the
gradients of the states it sent, and sends the gradients of the states it
received to the rank before it. The parameters are replicated; their
gradients are averaged by hand (``dist.all_reduce``, as that tutorial
does) and AdamW steps them.

    PYTHONPATH=tests/zoo python tests/zoo_heldout20/mamba2_sequence_parallel_state_passing_send_recv.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Step, average_gradients, batches, grow, main, receive, send
from job_parts import markov_sequences

VOCAB, WIDTH, HEADS, HEAD_CHANNELS, STATE, LAYERS = 64, 128, 4, 32, 8, 2
SEQUENCES, LENGTH, BATCH = 8192, 128, 32
INNER = HEADS * HEAD_CHANNELS
# floats in one message: a batch's state of one block (every head's
# channels by the state size), passed on, or its gradient passed back
MESSAGE = BATCH * HEADS * HEAD_CHANNELS * STATE


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """S[..., t, s] = a[..., s+1] + ... + a[..., t] for s <= t, -inf above
    (the log of the decay from position s to t), as ``segsum`` of the
    minimal SSD reference computes it."""
    length = a.shape[-1]
    cumulative = a.cumsum(-1)
    sums = cumulative[..., :, None] - cumulative[..., None, :]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return sums.masked_fill(~causal, float("-inf"))


class Mamba2Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(WIDTH)
        # the gate, the inputs, B, C and each head's step size
        self.project_in = nn.Linear(WIDTH, 2 * INNER + 2 * STATE + HEADS, bias=False)
        self.a_log = nn.Parameter(torch.log(torch.linspace(1.0, 16.0, HEADS)))
        self.step_bias = nn.Parameter(torch.log(torch.expm1(torch.linspace(1e-3, 1e-1, HEADS))))
        self.skip = nn.Parameter(torch.ones(HEADS))
        self.project_out = nn.Linear(INNER, WIDTH, bias=False)

    def local(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What a chunk makes of itself alone: its outputs (before the gate)
        with a zero state before it, its final state from within, and what
        the correction by the state before it needs (the gate, C and each
        position's decay from the chunk's start)."""
        b, length, _ = x.shape
        gate, inputs, b_in, c_out, step = self.project_in(self.norm(x)).split(
            [INNER, INNER, STATE, STATE, HEADS], dim=-1)
        step = F.softplus(step + self.step_bias)                       # (b, l, h)
        log_decay = (-self.a_log.exp() * step).transpose(1, 2)          # (b, h, l)
        u = inputs.view(b, length, HEADS, HEAD_CHANNELS)
        scaled = (u * step.unsqueeze(-1)).transpose(1, 2)               # (b, h, l, p)
        cumulative = log_decay.cumsum(-1)
        # within the chunk: (C B^T, masked by the decays) times the inputs
        scores = torch.matmul(c_out, b_in.transpose(1, 2)).unsqueeze(1)  # (b, 1, l, l)
        y = torch.matmul(scores * segment_sums(log_decay).exp(), scaled)  # (b, h, l, p)
        # the chunk's own final state: sum over s of decay(s -> end) x_s B_s^T
        to_end = (cumulative[..., -1:] - cumulative).exp().unsqueeze(-1)  # (b, h, l, 1)
        state = torch.matmul((scaled * to_end).transpose(2, 3), b_in.unsqueeze(1))  # (b, h, p, n)
        y = y + u.transpose(1, 2) * self.skip.view(1, HEADS, 1, 1)
        return y, state, gate, c_out, cumulative

    def finish(self, x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        y = y.transpose(1, 2).reshape(b, length, INNER)
        return x + self.project_out(y * F.silu(gate))


class Model(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Mamba2Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor,
                exchange: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The chunk's logits; ``exchange`` takes a block's decay over this
        chunk and its state from within it (a zero state before it), passes
        the whole state on and returns the state before this chunk. The
        slowed rank also runs the model on extra sequences (a zero state
        before them, nothing exchanged), in a call of their own (a batch of
        another size may be computed in another order), whose logits are
        dropped (their backward runs, on zeros)."""
        x = self.embed(tokens)
        grown = grow(x, self.rank, self.opts)
        logits = self.chunk(x, exchange)
        if len(grown) > len(x):
            alone = self.chunk(grown[len(x):], lambda _, state: torch.zeros_like(state))
            logits = torch.cat([logits, alone])[:len(x)]
        return logits

    def chunk(self, x: torch.Tensor,
              exchange: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        for block in self.blocks:
            assert isinstance(block, Mamba2Block)
            y, state, gate, c_out, cumulative = block.local(x)
            before = exchange(cumulative[..., -1:].exp().unsqueeze(-1), state)
            # the state before the chunk, decayed to each position and read out by C
            decayed = cumulative.exp().unsqueeze(-1)                       # (b, h, l, 1)
            y = y + torch.matmul(c_out.unsqueeze(1), before.transpose(2, 3)) * decayed
            x = block.finish(x, y, gate)
        return self.head(self.norm(x))


def build(rank: int, opts: Options) -> Step:
    world = dist.get_world_size()
    chunk = LENGTH // world
    torch.manual_seed(0)  # every rank starts from the same parameters
    model = Model(rank, opts)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    data = batches(markov_sequences(VOCAB, SEQUENCES, LENGTH), rank, opts, BATCH,
                   replicas=1, replica=0)
    mine = slice(rank * chunk, (rank + 1) * chunk)
    sent: list[tuple[dist.Work, torch.Tensor]] = []

    def message() -> torch.Tensor:
        return torch.empty(BATCH, HEADS, HEAD_CHANNELS, STATE)

    def pass_on(x: torch.Tensor, dst: int) -> None:
        x = x.detach().contiguous()
        sent.append((send(x, dst), x))

    def step(_: int) -> None:
        tokens, following = next(data)
        received: list[torch.Tensor] = []  # the states before this chunk, by block
        passed: list[torch.Tensor] = []    # the states after it, sent on

        def exchange(chunk_decay: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
            before = (receive(message(), rank - 1, opts).requires_grad_() if rank > 0
                      else torch.zeros(BATCH, HEADS, HEAD_CHANNELS, STATE))
            after = state + chunk_decay * before
            if rank < world - 1:
                pass_on(after, rank + 1)
                passed.append(after)
            received.append(before)
            return before

        logits = model(tokens[:, mine], exchange)
        loss = F.cross_entropy(logits.flatten(0, 1), following[:, mine].flatten())
        if rank < world - 1:
            # the gradients of the states this rank sent on, from the rank after it
            grads = [receive(message(), rank + 1, opts) for _ in passed]
            torch.autograd.backward([loss, *passed], [torch.ones(()), *grads])
        else:
            loss.backward()
        if rank > 0:
            for before in received:
                assert before.grad is not None
                pass_on(before.grad, rank - 1)
        for work, _buffer in sent:
            work.wait()
        sent.clear()
        average_gradients(model.parameters())
        optimizer.step()
        optimizer.zero_grad()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
