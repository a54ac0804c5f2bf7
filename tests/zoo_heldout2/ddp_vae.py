"""A variational autoencoder under DDP, as PyTorch's VAE example writes it
(a 784-400-20 encoder giving a mean and a log-variance, the
reparameterisation trick, a 20-400-784 decoder with a sigmoid; binary
cross-entropy plus the KL divergence), trained with RMSprop on flattened
28x28 images a DataLoader reads with a DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout2/ddp_vae.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

PIXELS, HIDDEN, LATENT, BATCH, IMAGES = 784, 400, 20, 128, 2048


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(PIXELS, HIDDEN)
        self.fc21, self.fc22 = nn.Linear(HIDDEN, LATENT), nn.Linear(HIDDEN, LATENT)
        self.fc3, self.fc4 = nn.Linear(LATENT, HIDDEN), nn.Linear(HIDDEN, PIXELS)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = F.relu(self.fc1(x))
        mu, logvar = self.fc21(h), self.fc22(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z)))), mu, logvar


def loss_function(recon: torch.Tensor, x: torch.Tensor, mu: torch.Tensor,
                  logvar: torch.Tensor) -> torch.Tensor:
    bce = F.binary_cross_entropy(recon, x, reduction="sum")
    return bce - 0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())


def images() -> Rows:
    g = torch.Generator().manual_seed(0)
    return Rows(torch.rand(IMAGES, PIXELS, generator=g))


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(VAE())
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-4)
    data = batches(images(), rank, opts, BATCH)

    def step(_: int) -> None:
        (x,) = next(data)
        optimizer.zero_grad()
        recon, mu, logvar = (t[:len(x)] for t in model(grow(x, rank, opts)))
        loss_function(recon, x, mu, logvar).backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
