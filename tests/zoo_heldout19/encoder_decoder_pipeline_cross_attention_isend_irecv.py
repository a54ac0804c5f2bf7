"""An encoder-decoder transformer (as ``nn.TransformerEncoderLayer`` and
``nn.TransformerDecoderLayer`` build one) split into a pipeline of four
stages whose links are not a chain: rank 0 embeds the source tokens and
runs the first encoder layer, rank 1 the second and the encoder's final
norm, so that its output is the memory both decoder stages attend to;
rank 1 sends each microbatch's memory to rank 2 and to rank 3, rank 2
embeds the decoder's input tokens and runs the first decoder layer (causal
self-attention, cross-attention to the memory), rank 3 the second decoder
layer, the final norm and the vocabulary's logits (cross-entropy). The
messages are the point-to-point of PyTorch's "Writing Distributed
Applications" tutorial (``dist.isend`` and ``dist.irecv``); the schedule
is GPipe's (all the microbatches' forwards, then their backwards, last
microbatch first). In the backward, the memory's gradients come back to
rank 1 from both decoder stages and are summed there before they go on to
rank 0. Each stage steps an Adafactor of its own (``torch.optim.Adafactor``,
factored second moments), as encoder-decoder models such as T5 are
trained. The task: reverse a token sequence (sequences of a random
first-order Markov chain); ranks 0, 2 and 3 read the batches (a
DataLoader over the whole data set: the source, the decoder's input and
the labels); rank 1 reads nothing.

    PYTHONPATH=tests/zoo python tests/zoo_heldout19/encoder_decoder_pipeline_cross_attention_isend_irecv.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Rows, Step, batches, grow, main, receive, send
from job_parts import markov_sequences

VOCAB, LENGTH, WIDTH, HEADS, SAMPLES = 64, 16, 64, 4, 8192
STAGES, BATCH, MICROBATCHES = 4, 32, 4
MICROBATCH = BATCH // MICROBATCHES
BOS = VOCAB  # the decoder's first input token, outside the vocabulary
# floats in one message between stages: a microbatch's activations (or
# their gradients), the encoder's memory and the decoder's alike
MESSAGE = MICROBATCH * LENGTH * WIDTH
CAUSAL = nn.Transformer.generate_square_subsequent_mask(LENGTH)


def with_extra(layer: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], rank: int,
               opts: Options) -> torch.Tensor:
    """``layer(*inputs)``; the slowed rank also runs ``layer`` on extra
    samples (of every input), in a call of their own (a batch of another
    size may be computed in another order), whose outputs are dropped
    (their backward runs, on zeros)."""
    grown = [grow(x, rank, opts) for x in inputs]
    y = layer(*inputs)
    if len(grown[0]) > len(inputs[0]):
        extra = layer(*(g[len(x):] for g, x in zip(grown, inputs)))
        y = torch.cat([y, extra])[:len(inputs[0])]
    return y


def encoder_layer() -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True,
                                      norm_first=True)


def decoder_layer() -> nn.TransformerDecoderLayer:
    return nn.TransformerDecoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True,
                                      norm_first=True)


class Embedding(nn.Module):
    """Token embeddings plus learned positions."""

    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(tokens, WIDTH)
        self.positions = nn.Parameter(0.02 * torch.randn(LENGTH, WIDTH))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions


class Stage(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        torch.manual_seed(rank)
        self.embed = (Embedding(VOCAB) if rank == 0 else Embedding(VOCAB + 1) if rank == 2
                      else None)
        self.layer = encoder_layer() if rank < 2 else decoder_layer()
        self.norm = nn.LayerNorm(WIDTH) if rank in (1, 3) else nn.Identity()
        self.head = nn.Linear(WIDTH, VOCAB) if rank == 3 else nn.Identity()

    def layers(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        if memory is None:
            return self.norm(self.layer(x))
        return self.head(self.norm(self.layer(x, memory, tgt_mask=CAUSAL, tgt_is_causal=True)))

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        inputs = (x,) if memory is None else (x, memory)
        return with_extra(self.layers, inputs, self.rank, self.opts)


def reversals() -> Rows:
    """Source sequences, the decoder's inputs (the reversed source shifted
    right behind ``BOS``) and the labels (the reversed source)."""
    source, _ = markov_sequences(VOCAB, SAMPLES, LENGTH).tensors
    target = source.flip(1)
    shifted = torch.cat([torch.full((SAMPLES, 1), BOS), target[:, :-1]], 1)
    return Rows(source, shifted, target.contiguous())


def build(rank: int, opts: Options) -> Step:
    assert dist.get_world_size() == STAGES
    stage = Stage(rank, opts)
    optimizer = torch.optim.Adafactor(stage.parameters(), lr=1e-2)
    data: Iterator[tuple[torch.Tensor, ...]] | None = (
        batches(reversals(), rank, opts, BATCH, replicas=1, replica=0) if rank != 1 else None)
    sent: list[tuple[dist.Work, torch.Tensor]] = []

    def pass_on(x: torch.Tensor, dst: int) -> None:
        x = x.detach().contiguous()
        sent.append((send(x, dst), x))

    def message() -> torch.Tensor:
        return torch.empty(MICROBATCH, LENGTH, WIDTH)

    def part(t: torch.Tensor, m: int) -> torch.Tensor:
        return t[m * MICROBATCH:(m + 1) * MICROBATCH]

    def step(_: int) -> None:
        source = shifted = labels = None
        if data is not None:
            source, shifted, labels = next(data)
        optimizer.zero_grad()
        kept: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        for m in range(MICROBATCHES):
            if rank == 0:
                assert source is not None
                y = stage(part(source, m))
                pass_on(y, 1)
                kept.append((y, []))
            elif rank == 1:
                x = receive(message(), 0, opts).requires_grad_()
                memory = stage(x)
                pass_on(memory, 2)
                pass_on(memory, 3)
                kept.append((memory, [x]))
            elif rank == 2:
                assert shifted is not None
                memory = receive(message(), 1, opts).requires_grad_()
                y = stage(part(shifted, m), memory)
                pass_on(y, 3)
                kept.append((y, [memory]))
            else:
                assert labels is not None
                memory = receive(message(), 1, opts).requires_grad_()
                x = receive(message(), 2, opts).requires_grad_()
                logits = stage(x, memory)
                loss = F.cross_entropy(logits.flatten(0, 1), part(labels, m).flatten())
                kept.append((loss / MICROBATCHES, [x, memory]))
        for output, inputs in reversed(kept):
            if rank == 3:
                output.backward()
                x, memory = inputs
                pass_on(x.grad, 2)
                pass_on(memory.grad, 1)
            elif rank == 2:
                output.backward(receive(message(), 3, opts))
                pass_on(inputs[0].grad, 1)
            elif rank == 1:
                # the memory's gradients from both decoder stages, summed
                grad = receive(message(), 2, opts) + receive(message(), 3, opts)
                output.backward(grad)
                pass_on(inputs[0].grad, 0)
            else:
                output.backward(receive(message(), 1, opts))
        for work, _ in sent:
            work.wait()
        sent.clear()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
