"""A masked-token Transformer encoder under DDP with ``static_graph=True``
and activation checkpointing, as DDP's documentation pairs them (a static
graph is what lets DDP run under reentrant checkpointing): an
``nn.TransformerEncoder`` (pre-norm layers, no dropout) whose layers each
run under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``,
so their forward keeps no activations and is run again in backward. With
a static graph DDP learns the set of parameters and the order their
gradients become ready in the first iteration, and from the second on
fires its bucket all-reduces in that order as each layer's recomputed
backward finishes. The task is BERT's masked-token prediction: 15% of each
sequence's tokens replaced by a mask token (the positions drawn once, with
the data), the model predicting the original tokens there (cross-entropy
on the masked positions only). AdamW (fused), sequences a DataLoader reads
with a DistributedSampler.

The slowed rank runs each layer's feed-forward half and the head on extra
sequences (hooks on the layer's first and second linear layers add them
and take them off); its attention is the healthy one, since the attention
moves the batch to the second dimension, where extra sequences would
interleave with the real ones in the weights' gradient sums and change
their rounding.

    PYTHONPATH=tests/zoo python tests/zoo_heldout10/ddp_checkpointed_encoder_static.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from launch import Options, Rows, Step, batches, grow, main

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = 1000, 64, 128, 4, 2
MASK, IGNORED = VOCAB, -100  # the mask token (one past the vocabulary); unscored targets
BATCH, SEQUENCES = 16, 2048


class MaskedEncoder(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.tokens = nn.Embedding(VOCAB + 1, WIDTH)
        self.positions = nn.Parameter(0.02 * torch.randn(CONTEXT, WIDTH))
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions
        for layer in self.encoder.layers:
            x = checkpoint(layer, x, use_reentrant=True)
        # the slowed rank runs the head on extra sequences too
        return self.head(self.norm(grow(x, self.rank, self.opts)))[:len(tokens)]


class ExtraRows:
    """Hooks on a layer of the slowed rank: its feed-forward half runs on
    extra sequences, added to the first linear layer's input and dropped
    from the second's output."""

    def __init__(self, layer: nn.TransformerEncoderLayer, rank: int, opts: Options) -> None:
        self.rank, self.opts, self.rows = rank, opts, 0
        layer.linear1.register_forward_pre_hook(self.grown)
        layer.linear2.register_forward_hook(self.trimmed)

    def grown(self, _: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        self.rows = len(inputs[0])
        return (grow(inputs[0], self.rank, self.opts), *inputs[1:])

    def trimmed(self, _: nn.Module, _inputs: Any, y: torch.Tensor) -> torch.Tensor:
        return y[:self.rows]


def masked_sequences() -> Rows:
    """Sequences of a random first-order Markov chain with 15% of the
    tokens masked; the targets: the original token where masked, else
    ``IGNORED``."""
    g = torch.Generator().manual_seed(0)
    successors = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)
    tokens = torch.empty(SEQUENCES, CONTEXT, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (SEQUENCES,), generator=g)
    for t in range(CONTEXT - 1):
        tokens[:, t + 1] = successors[tokens[:, t], torch.randint(0, 4, (SEQUENCES,), generator=g)]
    masked = torch.rand(SEQUENCES, CONTEXT, generator=g) < 0.15
    return Rows(tokens.masked_fill(masked, MASK), tokens.masked_fill(~masked, IGNORED))


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    encoder = MaskedEncoder(rank, opts)
    if rank in opts.slow_ranks:
        for layer in encoder.encoder.layers:
            ExtraRows(layer, rank, opts)
    model = DistributedDataParallel(encoder, static_graph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    data = batches(masked_sequences(), rank, opts, BATCH)

    def step(_: int) -> None:
        inputs, targets = next(data)
        optimizer.zero_grad()
        logits = model(inputs)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORED).backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
