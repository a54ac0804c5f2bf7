"""A text classifier with ``nn.TransformerEncoder`` under DDP, trained in
bfloat16 autocast on the CPU, as users write it after PyTorch's
transformer and automatic mixed precision tutorials: token embeddings and
learned positions, encoder layers (self-attention and a feed-forward
block; one, to keep the job small), a mean over the tokens and a linear classifier; the forward and
the loss under ``torch.autocast("cpu", torch.bfloat16)``, the backward and
AdamW (fused) outside it. Token sequences a DataLoader reads with a
DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout4/ddp_text_transformer_bf16.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

VOCAB, LENGTH, MODEL, HEADS, FEEDFORWARD, LAYERS = 2000, 64, 128, 4, 512, 1
CLASSES, BATCH, TEXTS = 4, 16, 1024


class Classifier(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.embedding = nn.Embedding(VOCAB, MODEL)
        self.position = nn.Parameter(torch.randn(LENGTH, MODEL) * 0.02)
        layer = nn.TransformerEncoderLayer(MODEL, HEADS, FEEDFORWARD, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.classifier = nn.Linear(MODEL, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # the slowed rank encodes extra sequences
        x = grow(self.embedding(tokens) + self.position, self.rank, self.opts)
        return self.classifier(self.encoder(x).mean(1))[:len(tokens)]


def texts() -> Rows:
    """Random token sequences whose class is the quarter of the vocabulary
    that a fifth of their tokens come from."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, CLASSES, (TEXTS,), generator=g)
    tokens = torch.randint(0, VOCAB, (TEXTS, LENGTH), generator=g)
    topical = torch.rand(TEXTS, LENGTH, generator=g) < 0.2
    quarter = VOCAB // CLASSES
    tokens = torch.where(topical, labels.view(-1, 1) * quarter + tokens % quarter, tokens)
    return Rows(tokens, labels)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(Classifier(rank, opts))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    data = batches(texts(), rank, opts, BATCH)

    def step(_: int) -> None:
        tokens, labels = next(data)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(tokens), labels)
        loss.backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
