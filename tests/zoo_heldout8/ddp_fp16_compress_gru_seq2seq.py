"""A GRU sequence-to-sequence model under DDP with gradient compression, as
PyTorch's DDP communication hooks document it: ``register_comm_hook`` with
``default_hooks.fp16_compress_hook``, so each gradient bucket is cast to
float16, all-reduced, divided by the world size and cast back. The model
follows the "NLP From Scratch: Translation with a Sequence to Sequence
Network and Attention" tutorial: a GRU encoder over the source tokens, a
GRU decoder started from the encoder's last hidden state and fed the target
tokens shifted by one (teacher forcing), Luong's dot-product attention of
each decoder state over the encoder's outputs (``bmm``), and a linear layer
over the vocabulary on the state and its context; the tokens are
"translated" by a fixed substitution and the sentence reversed.
Cross-entropy, gradients clipped by norm (as recurrent networks are
trained), Adam (fused). Pairs of sentences a DataLoader reads with a
DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout8/ddp_fp16_compress_gru_seq2seq.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

# LENGTH: short, as the tutorial keeps its sentences (under ten words)
VOCAB, LENGTH, EMBEDDING, HIDDEN = 512, 6, 64, 128
BATCH, PAIRS = 64, 4096
START = 0  # the decoder's first input


class Seq2Seq(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.source, self.target = nn.Embedding(VOCAB, EMBEDDING), nn.Embedding(VOCAB, EMBEDDING)
        self.encoder = nn.GRU(EMBEDDING, HIDDEN, batch_first=True)
        self.decoder = nn.GRU(EMBEDDING, HIDDEN, batch_first=True)
        self.out = nn.Linear(2 * HIDDEN, VOCAB)

    def forward(self, source: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        # the slowed rank encodes and decodes extra sentences (as many of each)
        encoded, state = self.encoder(grow(self.source(source), self.rank, self.opts))
        decoded, _ = self.decoder(grow(self.target(previous), self.rank, self.opts), state)
        weights = F.softmax(torch.bmm(decoded, encoded.transpose(1, 2)), dim=-1)
        context = torch.bmm(weights, encoded)
        return self.out(torch.cat([decoded, context], -1))[:len(source)]


def pairs() -> Rows:
    """Random sentences and their "translations": each token substituted
    by a fixed permutation of the vocabulary, the order reversed; the
    decoder's inputs are the translation shifted right by one."""
    g = torch.Generator().manual_seed(0)
    source = torch.randint(1, VOCAB, (PAIRS, LENGTH), generator=g)
    substitution = torch.cat([torch.zeros(1, dtype=torch.long),
                              1 + torch.randperm(VOCAB - 1, generator=g)])
    target = substitution[source].flip(1)
    previous = torch.cat([torch.full((PAIRS, 1), START), target[:, :-1]], 1)
    return Rows(source, previous, target)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(Seq2Seq(rank, opts))
    model.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    data = batches(pairs(), rank, opts, BATCH)

    def step(_: int) -> None:
        source, previous, target = next(data)
        optimizer.zero_grad()
        logits = model(source, previous)
        F.cross_entropy(logits.flatten(0, 1), target.flatten()).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
