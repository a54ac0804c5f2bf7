"""Differentially private SGD (DP-SGD: Abadi et al., "Deep Learning with
Differential Privacy", 2016) over four data-parallel ranks, its
per-sample gradients computed as PyTorch's "Per-sample-gradients"
tutorial computes them (``torch.func``: ``functional_call`` of the model,
``grad`` of one sample's loss, ``vmap`` over the batch), as Opacus does
with ``grad_sample_mode="functorch"``. Each rank clips every sample's
gradient to a total norm of at most 1, sums its clipped gradients into
one flat buffer and all-reduces it (``dist.all_reduce``, without
DistributedDataParallel: there is no backward for it to hook); every rank
then adds the same Gaussian noise (standard deviation 1.1 times the
clipping norm, from a generator seeded alike on every rank, so that the
replicas stay equal), divides by the global batch and hands the result to
SGD with momentum as the parameters' gradients. The model: an MLP of
three linear layers (Tanh, as DP-SGD prefers bounded activations) on
feature vectors around one of four centres per class (ten classes); each
rank reads its share of them (a DataLoader with a DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout19/dp_sgd_per_sample_clipping_vmap.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from launch import Options, Step, batches, grow, main
from job_parts import clustered_samples

FEATURES, HIDDEN, CLASSES, SAMPLES, BATCH = 128, 256, 10, 16384, 64
CLIP, NOISE_MULTIPLIER = 1.0, 1.1


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)  # every rank starts from the same parameters
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
                          nn.Tanh(), nn.Linear(HIDDEN, CLASSES))
    names = [name for name, _ in model.named_parameters()]
    parameters = [p for _, p in model.named_parameters()]
    optimizer = torch.optim.SGD(parameters, lr=0.05, momentum=0.9)
    data = batches(clustered_samples(CLASSES, SAMPLES, FEATURES), rank, opts, BATCH)
    noise = torch.Generator().manual_seed(1)  # alike on every rank
    world = dist.get_world_size()

    def sample_loss(values: tuple[torch.Tensor, ...], x: torch.Tensor,
                    label: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, dict(zip(names, values)), (x.unsqueeze(0),))
        return F.cross_entropy(logits, label.unsqueeze(0))

    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))

    def clipped_sum(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The sum of the samples' gradients, each clipped to norm ``CLIP``, flattened."""
        values = tuple(p.detach() for p in parameters)
        grads = per_sample(values, x, labels)
        flat = torch.cat([g.flatten(1) for g in grads], 1)
        scale = (CLIP / (flat.norm(dim=1, keepdim=True) + 1e-6)).clamp(max=1.0)
        return (flat * scale).sum(0)

    def step(_: int) -> None:
        features, labels = next(data)
        total = clipped_sum(features, labels)
        # the slowed rank also computes extra samples' gradients, in a call of
        # their own (a batch of another size may be computed in another
        # order), and drops them
        grown = grow(features, rank, opts)
        if len(grown) > len(features):
            extra = grown[len(features):]
            clipped_sum(extra, torch.zeros(len(extra), dtype=torch.long))
        dist.all_reduce(total)
        total += NOISE_MULTIPLIER * CLIP * torch.randn(total.shape, generator=noise)
        total /= world * BATCH
        for p, part in zip(parameters, total.split([p.numel() for p in parameters])):
            p.grad = part.view_as(p).clone()
        optimizer.step()
        optimizer.zero_grad()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
