"""ZeRO stage 2 written by hand (Rajbhandari et al., "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", 2020): every
rank holds the whole model but only a quarter of the optimizer's state and
of the gradients. After backward each rank flattens its gradients into
one vector (padded to a multiple of the world) and ``reduce_scatter_single``
sums them over the ranks, leaving each rank the sum for its own quarter
only; the full gradients are dropped. Each rank's AdamW steps its quarter
of the parameters (a flat float32 copy that it alone updates) with the
averaged gradient, and ``all_gather_single`` puts the updated quarters
back together into every rank's model. The model is a small MLP-Mixer
(Tolstikhin et al., 2021) on feature vectors read as 16 tokens of 64
channels: a token embedding, two Mixer layers (LayerNorm, an MLP across
the tokens, LayerNorm, an MLP across the channels, each residual), a final
LayerNorm, mean pooling and a linear classifier (cross-entropy). Each
rank reads its share of the samples (a DataLoader with a
DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout11/manual_zero2_reduce_scatter.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from launch import Options, Rows, Step, batches, grow, main
from job_parts import clustered_samples

# a sample: 16 tokens of 64 channels, embedded 128 wide
TOKENS, CHANNELS, WIDTH, LAYERS, CLASSES = 16, 64, 128, 2, 16
BATCH, SAMPLES = 64, 8192


def mlp(width: int) -> nn.Sequential:
    """The Mixer's MLP: four times wider inside, GELU."""
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


class MixerLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.tokens = nn.LayerNorm(WIDTH), mlp(TOKENS)
        self.norm2, self.channels = nn.LayerNorm(WIDTH), mlp(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts, self.embedding = rank, opts, nn.Linear(CHANNELS, WIDTH)
        self.layers = nn.Sequential(*(MixerLayer() for _ in range(LAYERS)))
        self.norm, self.classifier = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, CLASSES)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # the slowed rank runs the layers on extra samples
        x = grow(features.view(-1, TOKENS, CHANNELS), self.rank, self.opts)
        x = self.norm(self.layers(self.embedding(x)))
        return self.classifier(x.mean(1))[:len(features)]


def build(rank: int, opts: Options) -> Step:
    world = dist.get_world_size()
    torch.manual_seed(0)  # every rank starts from the same parameters
    model = Mixer(rank, opts)
    parameters = list(model.parameters())
    count = sum(p.numel() for p in parameters)
    quarter = -(-count // world)
    flat = torch.zeros(quarter * world)
    flat[:count] = parameters_to_vector(parameters).detach()
    # this rank's quarter of the parameters: all its optimizer steps
    owned = nn.Parameter(flat[rank * quarter:(rank + 1) * quarter].clone())
    optimizer = torch.optim.AdamW([owned], lr=1e-3, weight_decay=0.05)
    gradients, owned_gradient = torch.zeros(quarter * world), torch.empty(quarter)
    data = batches(clustered_samples(CLASSES, SAMPLES, TOKENS * CHANNELS), rank, opts, BATCH)

    def step(_: int) -> None:
        features, labels = next(data)
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(features), labels).backward()
        gradients[:count] = parameters_to_vector([p.grad for p in parameters])
        model.zero_grad(set_to_none=True)  # only the owned quarter is kept
        dist.reduce_scatter_single(owned_gradient, gradients)
        owned.grad = owned_gradient / world
        optimizer.step()
        dist.all_gather_single(flat, owned.detach())
        vector_to_parameters(flat[:count], parameters)
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
