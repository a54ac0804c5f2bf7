"""Distributed K-FAC, the Kronecker-factored approximate curvature
preconditioner (Martens and Grosse, "Optimizing Neural Networks with
Kronecker-factored Approximate Curvature", 2015), laid out over the ranks
as distributed K-FAC assigns its work (Ba, Grosse and Martens,
"Distributed Second-Order Optimization using Kronecker-Factored
Approximations", 2017; Pauloski et al., "Convolutional Neural Network
Training with Distributed K-FAC", 2020, and their ``kfac-pytorch``): an
MLP classifier (an input layer, two hidden layers, a classifier, ReLU
between them) under DistributedDataParallel, whose backward averages the
gradients. Each linear layer's Kronecker factors, A (its inputs' second
moment, a column of ones for the bias) and G (its outputs' gradients'
second moment), are computed by each rank over its own samples (a
forward pre-hook and a hook on the layer's output), all-reduced (one
``all_reduce`` of every layer's factors, flattened) and averaged into
running estimates, the same on every rank. Each layer's inverses are the
work of one rank (layer l's of rank l): it inverts its factors, damped
(``cholesky`` and ``cholesky_inverse``), and ``broadcast``-s both
inverses from itself to the others, four broadcasts from four roots.
Every rank then preconditions each layer's gradient (G^-1 grad A^-1)
and steps SGD with momentum. Each rank reads its share of the samples (a
DataLoader with a DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout16/kfac_factor_allreduce_inverse_broadcast.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Step, batches, grow, main
from job_parts import clustered_samples

FEATURES, CLASSES, WIDTH, HIDDEN_LAYERS = 64, 16, 192, 2
BATCH, SAMPLES, DAMPING, DECAY = 1024, 65536, 1e-2, 0.95
WIDTHS = (FEATURES, *[WIDTH] * (HIDDEN_LAYERS + 1), CLASSES)


class MLP(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(WIDTHS, WIDTHS[1:]))
        self.rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slowed rank runs its layers on extra samples, left out of the factors
        self.rows = len(x)
        h = grow(x, self.rank, self.opts)
        for layer in self.layers[:-1]:
            h = F.relu(layer(h))
        return self.layers[-1](h)[:len(x)]


class KFAC:
    """Each linear layer's factors, their running estimates and their inverses."""

    def __init__(self, model: MLP, rank: int, world: int) -> None:
        self.model, self.rank, self.world = model, rank, world
        self.layers = [layer for layer in model.layers if isinstance(layer, nn.Linear)]
        self.inputs: dict[nn.Linear, torch.Tensor] = {}
        self.output_grads: dict[nn.Linear, torch.Tensor] = {}
        self.sizes = [(layer.in_features + 1, layer.out_features) for layer in self.layers]
        self.a = [torch.eye(a) for a, _ in self.sizes]
        self.g = [torch.eye(g) for _, g in self.sizes]
        for layer in self.layers:
            layer.register_forward_pre_hook(self.saw_input)
            layer.register_forward_hook(self.will_see_output_grad)

    def saw_input(self, layer: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        assert isinstance(layer, nn.Linear)
        self.inputs[layer] = inputs[0][:self.model.rows].detach()

    def will_see_output_grad(self, layer: nn.Module, _: Any, output: torch.Tensor) -> None:
        assert isinstance(layer, nn.Linear)

        def saw(grad: torch.Tensor) -> None:
            self.output_grads[layer] = grad[:self.model.rows]
        output.register_hook(saw)

    def update_factors(self) -> None:
        """This rank's factors, all-reduced, into the running estimates."""
        own = []
        for layer in self.layers:
            x = self.inputs[layer]
            a = torch.cat([x, torch.ones(len(x), 1)], dim=1)
            g = self.output_grads[layer] * len(x)  # per-sample gradients of the mean loss
            own += [(a.t() @ a / len(x)).flatten(), (g.t() @ g / len(x)).flatten()]
        flat = torch.cat(own)
        dist.all_reduce(flat)
        parts = flat.div_(self.world).split([n * n for sizes in self.sizes for n in sizes])
        for i, (n_a, n_g) in enumerate(self.sizes):
            self.a[i].lerp_(parts[2 * i].view(n_a, n_a), 1 - DECAY)
            self.g[i].lerp_(parts[2 * i + 1].view(n_g, n_g), 1 - DECAY)

    def inverses(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's damped inverses, computed by its rank and broadcast from it."""
        found = []
        for i, (a, g) in enumerate(self.sizes):
            owner = i % self.world
            flat = torch.empty(a * a + g * g)
            if self.rank == owner:
                flat = torch.cat([damped_inverse(self.a[i]).flatten(),
                                  damped_inverse(self.g[i]).flatten()])
            dist.broadcast(flat, src=owner)
            a_inv, g_inv = flat.split([a * a, g * g])
            found.append((a_inv.view(a, a), g_inv.view(g, g)))
        return found

    def precondition(self) -> None:
        self.update_factors()
        for layer, (a_inv, g_inv) in zip(self.layers, self.inverses()):
            assert layer.weight.grad is not None and layer.bias.grad is not None
            grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)
            natural = g_inv @ grad @ a_inv
            layer.weight.grad.copy_(natural[:, :-1])
            layer.bias.grad.copy_(natural[:, -1])


def damped_inverse(factor: torch.Tensor) -> torch.Tensor:
    damped = factor + DAMPING ** 0.5 * torch.eye(len(factor))
    return torch.cholesky_inverse(torch.linalg.cholesky(damped))


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    mlp = MLP(rank, opts)
    kfac = KFAC(mlp, rank, dist.get_world_size())
    model = DistributedDataParallel(mlp)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    data = batches(clustered_samples(CLASSES, SAMPLES, FEATURES), rank, opts, BATCH)

    def step(_: int) -> None:
        features, labels = next(data)
        optimizer.zero_grad()
        F.cross_entropy(model(features), labels).backward()
        kfac.precondition()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
