"""Word embeddings learnt by skip-gram with negative sampling (word2vec:
Mikolov et al., "Distributed Representations of Words and Phrases and
their Compositionality", 2013) under DistributedDataParallel with sparse
gradients, as PyTorch's documentation pairs ``nn.Embedding(sparse=True)``
with ``torch.optim.SparseAdam``: two tables, the centre words' and the
context words', each an embedding with sparse gradients (only the rows a
batch looked up). Each sample is a centre word, a word within two
positions of it in the corpus and a negative word drawn from the unigram
distribution raised to the power 3/4 (drawn once, with the data); the
negatives are shared by the whole batch, as implementations of sampled
losses share their samples across a batch: every centre word is scored
against its context word (a dot product) and against all the batch's
negative words (one ``mm``), and the loss is the negative log-sigmoid of
the context's score plus ten times the mean negative log-sigmoid of the
negatives' negated scores. DDP all-reduces each table's sparse gradient
on its own (gloo's sparse all-reduce: every rank's indices and values
gathered and summed), then SparseAdam steps the rows seen. The corpus is
a random first-order Markov chain's token sequences; each rank reads its
share of the samples (a DataLoader with a DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout17/word2vec_sgns_sparse_ddp.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main, train_step
from job_parts import markov_sequences

VOCAB, DIMENSION, WINDOW, NEGATIVES = 2048, 64, 2, 10
SEQUENCES, LENGTH, BATCH = 2048, 32, 1024


class SkipGram(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.centres = nn.Embedding(VOCAB, DIMENSION, sparse=True)
        self.contexts = nn.Embedding(VOCAB, DIMENSION, sparse=True)
        nn.init.uniform_(self.centres.weight, -0.5 / DIMENSION, 0.5 / DIMENSION)
        nn.init.zeros_(self.contexts.weight)

    def forward(self, centres: torch.Tensor, contexts: torch.Tensor,
                negatives: torch.Tensor) -> torch.Tensor:
        """Each centre word's loss against its context word and the batch's negatives."""
        # the slowed rank scores extra samples
        v = grow(self.centres(centres), self.rank, self.opts)
        u = grow(self.contexts(contexts), self.rank, self.opts)
        positive = (v * u).sum(1)[:len(centres)]
        negative = (v @ self.contexts(negatives).T)[:len(centres)]
        return -F.logsigmoid(positive) - NEGATIVES * F.logsigmoid(-negative).mean(1)


def samples() -> Rows:
    """(centre, context, negative) words from the corpus."""
    tokens, _ = markov_sequences(VOCAB, SEQUENCES, LENGTH).tensors
    centres, contexts = [], []
    for offset in [o for o in range(-WINDOW, WINDOW + 1) if o]:
        lo, hi = max(0, -offset), LENGTH - max(0, offset)
        centres.append(tokens[:, lo:hi].flatten())
        contexts.append(tokens[:, lo + offset:hi + offset].flatten())
    centre, context = torch.cat(centres), torch.cat(contexts)
    g = torch.Generator().manual_seed(1)
    unigram = torch.bincount(tokens.flatten(), minlength=VOCAB).double() ** 0.75
    negative = torch.multinomial(unigram, len(centre), replacement=True, generator=g)
    return Rows(centre, context, negative)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(SkipGram(rank, opts))
    optimizer = torch.optim.SparseAdam(list(model.parameters()), lr=1e-3)
    data = batches(samples(), rank, opts, BATCH)

    def step(_: int) -> None:
        centres, contexts, negatives = next(data)
        train_step(lambda: model(centres, contexts, negatives).mean(), optimizer, opts)
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
