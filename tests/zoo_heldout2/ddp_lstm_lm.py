"""A word-level LSTM language model under DDP, as PyTorch's
word_language_model example writes it (embedding, two-layer LSTM, dropout,
a linear decoder, cross-entropy over the next token), trained with
truncated backpropagation through time: the hidden state is carried from
one step's chunk of the sequences to the next, detached. SGD with gradient
clipping; token chunks a DataLoader reads with a DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout2/ddp_lstm_lm.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

TOKENS, EMBED, HIDDEN, LAYERS, BPTT, BATCH, CHUNKS = 2000, 128, 128, 2, 16, 16, 512
State = tuple[torch.Tensor, torch.Tensor]


class RNNModel(nn.Module):
    """``widen``: what the embedded batch goes through before the LSTM (the
    slowed rank's extra sequences, which get a fresh state and no loss)."""

    def __init__(self, widen: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.widen = widen
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(TOKENS, EMBED)
        self.rnn = nn.LSTM(EMBED, HIDDEN, LAYERS, dropout=0.2, batch_first=True)
        self.decoder = nn.Linear(HIDDEN, TOKENS)

    def forward(self, tokens: torch.Tensor, hidden: State) -> tuple[torch.Tensor, State]:
        x = self.widen(self.drop(self.encoder(tokens)))
        fresh = torch.zeros(LAYERS, len(x) - len(tokens), HIDDEN)
        output, (h, c) = self.rnn(x, tuple(torch.cat([s, fresh], 1) for s in hidden))
        rows = len(tokens)
        return self.decoder(self.drop(output))[:rows], (h[:, :rows], c[:, :rows])


def chunks() -> Rows:
    """Chunks of a random corpus, each with its next-token targets."""
    g = torch.Generator().manual_seed(0)
    corpus = torch.randint(0, TOKENS, (CHUNKS * BPTT + 1,), generator=g)
    return Rows(corpus[:-1].view(CHUNKS, BPTT), corpus[1:].view(CHUNKS, BPTT))


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(RNNModel(lambda x: grow(x, rank, opts)))
    optimizer = torch.optim.SGD(model.parameters(), lr=20.0)
    data = batches(chunks(), rank, opts, BATCH)
    hidden = [(torch.zeros(LAYERS, BATCH, HIDDEN), torch.zeros(LAYERS, BATCH, HIDDEN))]

    def step(_: int) -> None:
        tokens, targets = next(data)
        optimizer.zero_grad()
        state = (hidden[0][0].detach(), hidden[0][1].detach())  # repackage_hidden
        logits, hidden[0] = model(tokens, state)
        F.cross_entropy(logits.reshape(-1, TOKENS), targets.reshape(-1)).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
