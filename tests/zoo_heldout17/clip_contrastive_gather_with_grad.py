"""Contrastive image-text pre-training (CLIP: Radford et al., "Learning
Transferable Visual Models From Natural Language Supervision", 2021)
under DistributedDataParallel, its loss over the global batch computed as
open_clip's ``ClipLoss`` does with ``gather_with_grad`` and ``local_loss``:
each rank embeds its images and their captions, all-gathers both
embeddings with ``torch.distributed.nn.functional.all_gather`` (an
autograd all-gather: its backward sends each rank the gradients of its
own embeddings from every rank, on gloo one ``scatter`` from each rank in
turn), and scores its own images against every rank's captions and its
own captions against every rank's images, its labels the positions of its
own pairs in the gathered batch (cross-entropy both ways, averaged); the
gradients of the towers are then averaged by DDP. Two towers: an image
encoder (three 3x3 convolutions without biases, with GELU, the last two
strided, global average pooling and a linear projection without a bias,
as CLIP's) and a text encoder (token and position embeddings, a pre-norm
``nn.TransformerEncoderLayer`` with a causal mask, a final LayerNorm, the
last token's features to a linear projection without a bias), both to a
shared embedding, L2-normalised; a learned temperature (the logit scale,
``log(1/0.07)`` at the start, clamped to at most 100 after each step as
open_clip does). AdamW (fused) with CLIP's betas (0.9, 0.98), epsilon
1e-6 and weight decay 0.2 on the weight matrices (not on the gains,
biases and the logit scale, which open_clip leaves out). The pairs are
16x16 three-channel images around one of four centres per class and a
caption of their class (the class's words with a quarter of them replaced
by random words); each rank reads its share of them (a DataLoader with a
DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout17/clip_contrastive_gather_with_grad.py --out DIR
"""
from __future__ import annotations

import math
import sys
from typing import Callable

import torch
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main, train_step
from job_parts import clustered_samples

CHANNELS, SIDE, CLASSES, PAIRS = 3, 16, 32, 16384
VOCAB, WORDS, WIDTH, HEADS, EMBED = 1024, 16, 64, 4, 64
BATCH = 48
TEMPERATURE = 0.07


def with_extra(encode: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rank: int,
               opts: Options) -> torch.Tensor:
    """``encode(x)``; the slowed rank also encodes extra samples, in a call
    of their own (a batch of another size may be computed in another
    order), whose outputs are dropped (their backward runs, on zeros)."""
    grown = grow(x, rank, opts)
    y = encode(x)
    if len(grown) > len(x):
        y = torch.cat([y, encode(grown[len(x):])])[:len(x)]
    return y


class ImageEncoder(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.convs = nn.Sequential(
            nn.Conv2d(CHANNELS, 16, 3, padding=1, bias=False), nn.GELU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.GELU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False), nn.GELU())
        self.projection = nn.Linear(64, EMBED, bias=False)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        return self.projection(F.adaptive_avg_pool2d(self.convs(images), 1).flatten(1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return with_extra(self.encode, images, self.rank, self.opts)


class TextEncoder(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(WORDS, WIDTH)
        self.layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0,
                                                activation="gelu", batch_first=True,
                                                norm_first=True)
        self.norm = nn.LayerNorm(WIDTH)
        self.projection = nn.Linear(WIDTH, EMBED, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(WORDS))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer(x, src_mask=self.mask, is_causal=True)
        return self.projection(self.norm(x[:, -1]))

    def forward(self, captions: torch.Tensor) -> torch.Tensor:
        return with_extra(self.encode, self.tokens(captions) + self.positions.weight,
                          self.rank, self.opts)


class CLIP(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.images, self.texts = ImageEncoder(rank, opts), TextEncoder(rank, opts)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / TEMPERATURE)))

    def forward(self, images: torch.Tensor,
                captions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (F.normalize(self.images(images), dim=-1),
                F.normalize(self.texts(captions), dim=-1), self.logit_scale.exp())


def clip_loss(image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor,
              rank: int) -> torch.Tensor:
    """open_clip's ``ClipLoss(local_loss=True, gather_with_grad=True)``."""
    all_images = torch.cat(dist_fn.all_gather(image))
    all_texts = torch.cat(dist_fn.all_gather(text))
    labels = torch.arange(len(image)) + rank * len(image)
    return (F.cross_entropy(scale * image @ all_texts.T, labels)
            + F.cross_entropy(scale * text @ all_images.T, labels)) / 2


def pairs() -> Rows:
    images, labels = clustered_samples(CLASSES, PAIRS, CHANNELS * SIDE * SIDE).tensors
    g = torch.Generator().manual_seed(1)
    words = torch.randint(0, VOCAB, (CLASSES, WORDS), generator=g)
    captions = words[labels]
    replaced = torch.rand(PAIRS, WORDS, generator=g) < 0.25
    captions[replaced] = torch.randint(0, VOCAB, (int(replaced.sum()),), generator=g)
    return Rows(images.view(PAIRS, CHANNELS, SIDE, SIDE), captions)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    clip = CLIP(rank, opts)
    model = DistributedDataParallel(clip)
    decayed = [p for p in model.parameters() if p.ndim >= 2]
    kept = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.2},
                                   {"params": kept, "weight_decay": 0.0}],
                                  lr=5e-4, betas=(0.9, 0.98), eps=1e-6, fused=True)
    data = batches(pairs(), rank, opts, BATCH)

    def step(_: int) -> None:
        images, captions = next(data)

        def loss() -> torch.Tensor:
            image, text, scale = model(images, captions)
            return clip_loss(image, text, scale, rank)
        train_step(loss, optimizer, opts)
        with torch.no_grad():
            clip.logit_scale.clamp_(0, math.log(100))
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
