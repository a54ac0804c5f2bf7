"""A small GPT under DDP: token and position embeddings, a pre-norm
transformer block (``nn.TransformerEncoderLayer`` with a causal mask, GELU),
a final norm and a language-model head, trained with AdamW (fused,
weight decay 0.1) on next-token prediction over sequences a DataLoader reads.

    PYTHONPATH=tests/zoo python tests/zoo_heldout/ddp_gpt.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = 256, 64, 128, 4, 1
BATCH, SEQUENCES = 8, 256


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(CONTEXT))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x, src_mask=self.causal, is_causal=True)
        return self.head(self.norm(x))


def sequences() -> Rows:
    g = torch.Generator().manual_seed(0)
    return Rows(torch.randint(0, VOCAB, (SEQUENCES, CONTEXT + 1), generator=g))


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(GPT())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    data = batches(sequences(), rank, opts, BATCH)

    def step(_: int) -> None:
        (tokens,) = next(data)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits = model(grow(inputs, rank, opts).clamp(0, VOCAB - 1).long())[:len(inputs)]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
