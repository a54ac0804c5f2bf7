"""Uneven inputs under DDP, handled by the ``Join`` context manager as
PyTorch's "Distributed Training with Uneven Inputs Using the Join Context
Manager" tutorial does: the ranks' shares of the data differ in length (the
data does not divide evenly: in each epoch one rank holds a batch fewer
than the others, a different rank each epoch), and each epoch runs inside
``with Join([model])``. While any rank still has batches, every rank that
has not joined all-reduces a flag before each forward; a rank that has run
out joins and shadows the others' collectives (the flag's all-reduce and
DDP's gradient all-reduce, of zeros) until all have joined. One epoch is
one iteration here, with an optimizer step per batch. The model is a
convolutional sentence classifier after Kim's "Convolutional Neural
Networks for Sentence Classification" and its PyTorch ports: word
embeddings, parallel 1-d convolutions over windows of three, four and five
words with ReLU, max-pooling over time, dropout and a linear classifier;
cross-entropy, SGD with momentum (fused). Sentences a DataLoader reads
with a DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout7/ddp_join_textcnn.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

VOCAB, WORDS, EMBEDDING, FILTERS, CLASSES = 2000, 64, 64, 64, 4
WINDOWS = (3, 4, 5)
BATCH, SENTENCES, BATCHES = 32, 4096, 2  # BATCHES: in an epoch, on all ranks but one


class TextCNN(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.embedding = nn.Embedding(VOCAB, EMBEDDING)
        self.convolutions = nn.ModuleList(nn.Conv1d(EMBEDDING, FILTERS, window)
                                          for window in WINDOWS)
        self.dropout = nn.Dropout(0.5)
        self.classifier = nn.Linear(len(WINDOWS) * FILTERS, CLASSES)

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        # the slowed rank classifies extra sentences
        x = grow(self.embedding(words), self.rank, self.opts).transpose(1, 2)
        pooled = [F.relu(convolution(x)).amax(2) for convolution in self.convolutions]
        return self.classifier(self.dropout(torch.cat(pooled, 1)))[:len(words)]


def sentences() -> Rows:
    """Random sentences, each of one class: a few of its words are drawn
    from its class's own vocabulary, the others from a common one."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, CLASSES, (SENTENCES,), generator=g)
    common = torch.randint(CLASSES * 100, VOCAB, (SENTENCES, WORDS), generator=g)
    own = labels.view(-1, 1) * 100 + torch.randint(0, 100, (SENTENCES, WORDS), generator=g)
    telling = torch.rand(SENTENCES, WORDS, generator=g) < 0.1
    return Rows(torch.where(telling, own, common), labels)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(TextCNN(rank, opts))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
    data = batches(sentences(), rank, opts, BATCH)

    world = dist.get_world_size()

    def epoch(i: int) -> None:
        short = i % world  # the rank whose share is a batch short this epoch
        with Join([model]):
            for _ in range(BATCHES - (rank == short)):
                words, labels = next(data)
                optimizer.zero_grad()
                F.cross_entropy(model(words), labels).backward()
                optimizer.step()
    return epoch


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
