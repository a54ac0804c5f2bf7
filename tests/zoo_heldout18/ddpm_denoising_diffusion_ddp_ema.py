"""A denoising diffusion model (DDPM: Ho, Jain and Abbeel, "Denoising
Diffusion Probabilistic Models", 2020) trained under
DistributedDataParallel, with an exponential moving average of its
weights kept by ``torch.optim.swa_utils.AveragedModel`` as PyTorch's
documentation writes one (``get_ema_multi_avg_fn``, updated after every
optimizer step). Each step every rank takes its share of the images,
draws a diffusion time for each (uniform over the 1,000 steps of a
linear noise schedule) and Gaussian noise from a generator of its own,
noises the images to that time in closed form and trains the network to
predict the noise (the mean-square error, DDPM's simplified loss). The
network: a sinusoidal embedding of the time through a small MLP (SiLU),
added per channel after each of two 3x3 convolutions with GroupNorm and
SiLU, and a 3x3 convolution back to the image's channels; Adam at
2e-4 with the gradients' norm clipped to 1, as DDPM trains. The images
are 16x16 single-channel images around one of four centres per class
(the classes unused); each rank reads its share of them (a DataLoader
with a DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout18/ddpm_denoising_diffusion_ddp_ema.py --out DIR
"""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from launch import Options, Rows, Step, batches, grow, main
from job_parts import clustered_samples

SIDE, CHANNELS, EMBEDDING, CLASSES, IMAGES = 16, 32, 64, 8, 8192
TIMES, BATCH, EMA_DECAY = 1000, 32, 0.999
BETAS = torch.linspace(1e-4, 0.02, TIMES, dtype=torch.float64)
ALPHAS_CUMPROD = torch.cumprod(1 - BETAS, 0).float()


def time_embedding(t: torch.Tensor) -> torch.Tensor:
    """The Transformer's sinusoidal embedding of each diffusion time."""
    half = EMBEDDING // 2
    frequencies = torch.exp(-math.log(10000.0) * torch.arange(half) / half)
    angles = t.float()[:, None] * frequencies[None]
    return torch.cat([angles.sin(), angles.cos()], 1)


class Denoiser(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.time = nn.Sequential(nn.Linear(EMBEDDING, 4 * EMBEDDING), nn.SiLU(),
                                  nn.Linear(4 * EMBEDDING, 2 * CHANNELS))
        self.first = nn.Conv2d(1, CHANNELS, 3, padding=1)
        self.second = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1)
        self.norms = nn.ModuleList(nn.GroupNorm(8, CHANNELS) for _ in range(2))
        self.out = nn.Conv2d(CHANNELS, 1, 3, padding=1)

    def predict(self, x: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        shifts = self.time(embedded)[:, :, None, None].chunk(2, 1)
        h = F.silu(self.norms[0](self.first(x) + shifts[0]))
        h = F.silu(self.norms[1](self.second(h) + shifts[1]))
        return self.out(h)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        embedded = time_embedding(t)
        y = self.predict(x, embedded)
        # the slowed rank also denoises extra samples, in a call of their own
        # (a batch of another size may be computed in another order), whose
        # outputs are dropped (their backward runs, on zeros)
        grown_x, grown_e = grow(x, self.rank, self.opts), grow(embedded, self.rank, self.opts)
        if len(grown_x) > len(x):
            y = torch.cat([y, self.predict(grown_x[len(x):], grown_e[len(x):])])[:len(x)]
        return y


def images() -> Rows:
    samples, _ = clustered_samples(CLASSES, IMAGES, SIDE * SIDE).tensors
    scaled = samples / samples.abs().amax(1, keepdim=True)  # to [-1, 1], as DDPM scales
    return Rows(scaled.view(IMAGES, 1, SIDE, SIDE))


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    denoiser = Denoiser(rank, opts)
    model = DistributedDataParallel(denoiser)
    ema = AveragedModel(denoiser, multi_avg_fn=get_ema_multi_avg_fn(EMA_DECAY))
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-4)
    data = batches(images(), rank, opts, BATCH)
    noise = torch.Generator().manual_seed(rank)  # each rank its own times and noise

    def step(_: int) -> None:
        (x0,) = next(data)
        t = torch.randint(0, TIMES, (len(x0),), generator=noise)
        eps = torch.randn(x0.shape, generator=noise)
        a = ALPHAS_CUMPROD[t][:, None, None, None]
        xt = a.sqrt() * x0 + (1 - a).sqrt() * eps
        F.mse_loss(model(xt, t), eps).backward()
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        ema.update_parameters(denoiser)
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
