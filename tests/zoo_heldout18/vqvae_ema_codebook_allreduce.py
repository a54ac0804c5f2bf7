"""A vector-quantised autoencoder (VQ-VAE: van den Oord, Vinyals and
Kavukcuoglu, "Neural Discrete Representation Learning", 2017) under
DistributedDataParallel, its codebook learnt by exponential moving
averages (the paper's appendix) over the global batch, as distributed
VQ-VAE trainers keep it: in each forward every rank assigns each of its
latent vectors to the nearest code (squared distances from one ``mm``),
counts its assignments per code and sums the vectors assigned to each,
and all-reduces the counts and sums (one ``dist.all_reduce`` of both,
flattened); every rank then moves the codebook's averages by the same
global statistics (decay 0.99, the counts Laplace-smoothed), so the
codebook, a buffer DDP does not broadcast (``broadcast_buffers=False``),
stays the same on every rank. The encoder (two 4x4 convolutions of
stride 2 with ReLU, then a 1x1 convolution to the codes' width) and the
decoder (a 3x3 convolution, then two 4x4 transposed convolutions of
stride 2 with ReLU between) learn by the reconstruction's mean-square
error, the quantised latents passed straight through to the encoder,
plus the commitment loss (0.25); DDP averages their gradients and Adam
(2e-4, as the paper) steps them. The images are 16x16 three-channel
images around one of four centres per class (the classes unused); each
rank reads its share of them (a DataLoader with a DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout18/vqvae_ema_codebook_allreduce.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main, train_step
from job_parts import clustered_samples

CHANNELS, SIDE, HIDDEN, CODE_WIDTH, CODES = 3, 16, 64, 32, 256
CLASSES, IMAGES, BATCH = 16, 16384, 48
DECAY, EPSILON, COMMITMENT = 0.99, 1e-5, 0.25


def with_extra(layers: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rank: int,
               opts: Options) -> torch.Tensor:
    """``layers(x)``; the slowed rank also runs ``layers`` on extra samples,
    in a call of their own (a batch of another size may be computed in
    another order), whose outputs are dropped (their backward runs, on
    zeros; they never reach the codebook)."""
    grown = grow(x, rank, opts)
    y = layers(x)
    if len(grown) > len(x):
        y = torch.cat([y, layers(grown[len(x):])])[:len(x)]
    return y


class VQVAE(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.encoder = nn.Sequential(
            nn.Conv2d(CHANNELS, HIDDEN, 4, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(HIDDEN, HIDDEN, 4, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(HIDDEN, CODE_WIDTH, 1))
        self.decoder = nn.Sequential(
            nn.Conv2d(CODE_WIDTH, HIDDEN, 3, padding=1), nn.ReLU(),
            nn.ConvTranspose2d(HIDDEN, HIDDEN, 4, stride=2, padding=1), nn.ReLU(),
            nn.ConvTranspose2d(HIDDEN, CHANNELS, 4, stride=2, padding=1))
        codebook = torch.randn(CODES, CODE_WIDTH)
        self.register_buffer("codebook", codebook)
        self.register_buffer("cluster_size", torch.ones(CODES))
        self.register_buffer("code_sums", codebook.clone())

    def quantise(self, z: torch.Tensor) -> torch.Tensor:
        """Each latent vector's nearest code; in training the codebook's
        moving averages move by the global batch's assignments."""
        flat = z.permute(0, 2, 3, 1).reshape(-1, CODE_WIDTH)
        distances = (flat.square().sum(1, keepdim=True) - 2 * flat @ self.codebook.T
                     + self.codebook.square().sum(1))
        codes = distances.argmin(1)
        quantised = self.codebook[codes].view(z.shape[0], z.shape[2], z.shape[3], CODE_WIDTH)
        if self.training:
            with torch.no_grad():
                assigned = F.one_hot(codes, CODES).to(flat.dtype)
                statistics = torch.cat([assigned.sum(0), (assigned.T @ flat).flatten()])
                dist.all_reduce(statistics)
                counts, sums = statistics.split([CODES, CODES * CODE_WIDTH])
                self.cluster_size.mul_(DECAY).add_(counts, alpha=1 - DECAY)
                self.code_sums.mul_(DECAY).add_(sums.view(CODES, CODE_WIDTH), alpha=1 - DECAY)
                total = self.cluster_size.sum()
                smoothed = (self.cluster_size + EPSILON) / (total + CODES * EPSILON) * total
                self.codebook.copy_(self.code_sums / smoothed[:, None])
        return quantised.permute(0, 3, 1, 2)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        z = with_extra(self.encoder, images, self.rank, self.opts)
        quantised = self.quantise(z)
        commitment = F.mse_loss(z, quantised.detach())
        passed = z + (quantised - z).detach()  # the straight-through estimator
        decoded = with_extra(self.decoder, passed, self.rank, self.opts)
        return F.mse_loss(decoded, images) + COMMITMENT * commitment


def images() -> Rows:
    samples, _ = clustered_samples(CLASSES, IMAGES, CHANNELS * SIDE * SIDE).tensors
    return Rows(samples.view(IMAGES, CHANNELS, SIDE, SIDE))


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(VQVAE(rank, opts), broadcast_buffers=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-4)
    data = batches(images(), rank, opts, BATCH)

    def step(_: int) -> None:
        (x,) = next(data)
        train_step(lambda: model(x), optimizer, opts)
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
