"""Stein variational gradient descent (Liu and Wang, "Stein Variational
Gradient Descent: A General Purpose Bayesian Inference Algorithm", 2016)
for a Bayesian neural network's posterior, its particles spread over the
ranks: each rank holds 8 of the 32 particles, every particle a whole
set of weights of an MLP regressor (32 -> 128 -> 128 -> 1, ReLU) kept as
one flat vector. Each step every rank reads the same batch (a
DataLoader over the whole data set) and takes, for each of its
particles, the gradient of the log posterior (the batch's Gaussian
log-likelihood with noise 0.3, scaled to the whole data set, plus a
standard normal prior on every weight) with respect to the particle:
one batched forward of all its particles (``torch.func.vmap`` over
``functional_call``) and ``torch.autograd.grad``. The ranks then
gather every particle and its gradient (one ``dist.all_gather_single``
of both), and every rank computes the RBF kernel over all 32 particles
(its bandwidth by the paper's median heuristic, the median squared
distance over log(n + 1), as its reference code sets it) and moves its
own particles along the Stein direction: the kernel-weighted mean of all
particles' gradients, which pulls them to high posterior, plus the
kernel's gradient, which pushes them apart. The direction is handed to
Adagrad (as the paper's experiments step it) as the particles' negative
gradient. The data: feature vectors from a standard normal, their
targets from a random teacher network (the same architecture),
standardised, plus noise.

    PYTHONPATH=tests/zoo python tests/zoo_heldout21/svgd_bayesian_mlp_particles_allgather.py --out DIR
"""
from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call, vmap

from launch import Options, Rows, Step, batches, grow, main

FEATURES, HIDDEN, SAMPLES, BATCH = 32, 128, 16384, 1024
PARTICLES_PER_RANK, NOISE = 8, 0.3


def regressor() -> nn.Sequential:
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN),
                         nn.ReLU(), nn.Linear(HIDDEN, 1))


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def regression() -> Rows:
    torch.manual_seed(1_000)  # the teacher
    teacher = regressor()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    with torch.no_grad():
        signal = teacher(x).squeeze(1)
    signal = (signal - signal.mean()) / signal.std()
    return Rows(x, signal + NOISE * torch.randn(SAMPLES, generator=g))


def build(rank: int, opts: Options) -> Step:
    world = dist.get_world_size()
    count = world * PARTICLES_PER_RANK
    template = regressor()
    names = [name for name, _ in template.named_parameters()]
    shapes = [p.shape for _, p in template.named_parameters()]
    sizes = [p.numel() for _, p in template.named_parameters()]
    torch.manual_seed(rank)  # each rank its own particles, drawn as PyTorch initialises
    particles = nn.Parameter(torch.stack([flat(regressor()) for _ in range(PARTICLES_PER_RANK)]))
    optimizer = torch.optim.Adagrad([particles], lr=1e-2)
    data = batches(regression(), rank, opts, BATCH, replicas=1, replica=0)
    mine = slice(rank * PARTICLES_PER_RANK, (rank + 1) * PARTICLES_PER_RANK)

    def log_likelihoods(weights: torch.Tensor, x: torch.Tensor,
                        y: torch.Tensor) -> torch.Tensor:
        """Each sample's Gaussian log-likelihood under one particle's weights."""
        values = {n: part.view(s) for n, s, part in zip(names, shapes, weights.split(sizes))}
        predicted = functional_call(template, values, (x,)).squeeze(-1)
        return -0.5 * ((predicted - y) / NOISE).square()

    def batched(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return vmap(log_likelihoods, in_dims=(0, None, None))(particles, x, y)

    def step(_: int) -> None:
        x, y = next(data)
        per_sample = batched(x, y)  # (particles, samples)
        # the slowed rank also evaluates its particles on extra samples, in a
        # call of their own (a batch of another size may be computed in
        # another order), whose likelihoods are dropped (their backward runs,
        # on zeros)
        grown = grow(x, rank, opts)
        if len(grown) > len(x):
            extra = batched(grown[len(x):], torch.zeros(len(grown) - len(x)))
            per_sample = torch.cat([per_sample, extra], 1)[:, :len(x)]
        log_posterior = per_sample.sum(1) * (SAMPLES / BATCH) - 0.5 * particles.square().sum(1)
        (score,) = torch.autograd.grad(log_posterior.sum(), particles)
        everything = torch.empty(count, 2, particles.shape[1])
        dist.all_gather_single(everything, torch.stack([particles.detach(), score], 1))
        every_particle, every_score = everything.unbind(1)
        squared = every_particle.square().sum(1)
        distances = (squared[:, None] + squared[None] - 2 * every_particle @ every_particle.T)
        distances = distances.clamp_min(0.0)
        pairs = torch.triu_indices(count, count, offset=1)
        bandwidth = distances[pairs[0], pairs[1]].median() / math.log(count + 1)
        kernel = torch.exp(-distances[mine] / bandwidth)  # (own particles, all particles)
        repulsion = (particles.detach() * kernel.sum(1, keepdim=True)
                     - kernel @ every_particle) * (2 / bandwidth)
        direction = (kernel @ every_score + repulsion) / count
        particles.grad = -direction
        optimizer.step()
        optimizer.zero_grad()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
