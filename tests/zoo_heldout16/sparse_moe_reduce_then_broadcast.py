"""A sparsely-gated mixture-of-experts classifier trained data parallel, its
gradients summed with ``dist.reduce`` to rank 0 and sent back with
``dist.broadcast`` from it, the two collectives of PyTorch's "Writing
Distributed Applications" tutorial that an all-reduce is made of when it
is written as a reduction to a root and the root's broadcast (as
parameter-server and early data-parallel frameworks average gradients).
The mixture is the Switch Transformer's (Shazeer et al., "Outrageously
Large Neural Networks: The Sparsely-Gated Mixture-of-Experts Layer", 2017;
Fedus, Zoph and Shazeer, "Switch Transformers", 2021), replicated on every
rank (no expert parallelism): after a LayerNorm, a linear router picks one
of four experts for each sample (top-1 of its softmax), each expert (a
linear layer twice wider, GELU, a linear layer back) runs on the samples
routed to it, and its outputs, scaled by their router probabilities, are
added to the residual; the Switch Transformer's load-balancing loss (the
experts' shares of the samples times their mean router probabilities,
summed, times the number of experts, weighted 0.01) is added to the
cross-entropy. Around the mixture: an input layer before it, a final
LayerNorm and a linear classifier after it. After the backward each rank
joins its gradients into one flat buffer, reduces it to rank 0
(``dist.reduce``, a sum) and receives rank 0's sum (``dist.broadcast``),
so every rank holds the same sum bit for bit; it is divided by the world
size and copied back into the gradients; Adam (fused). Each rank reads its
share of the samples (a DataLoader with a DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout16/sparse_moe_reduce_then_broadcast.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Step, batches, grow, main
from job_parts import clustered_samples, flat_gradients, unflatten_gradients

FEATURES, CLASSES, WIDTH, EXPERTS, EXPANSION = 64, 16, 128, 4, 2
BATCH, SAMPLES, ROOT, BALANCE = 2048, 65536, 0, 0.01


class SwitchLayer(nn.Module):
    """Top-1 routing to one of ``EXPERTS`` feed-forward experts (pre-norm, residual)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.router = nn.Linear(WIDTH, EXPERTS)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, EXPANSION * WIDTH), nn.GELU(),
                          nn.Linear(EXPANSION * WIDTH, WIDTH)) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The output and the load-balancing loss (of the first ``rows`` samples)."""
        h = self.norm(x)
        probabilities = self.router(h).softmax(dim=-1)
        gate, choice = probabilities.max(dim=-1)
        out = torch.zeros_like(h)
        # a slowed rank's extra samples go to their experts in calls of their
        # own (an expert's weight gradient over more rows may be summed in
        # another order)
        parts = [slice(0, rows)] + ([slice(rows, len(h))] if len(h) > rows else [])
        for e, expert in enumerate(self.experts):
            for part in parts:  # every expert runs, on no samples if none is routed to it
                chosen = (choice[part] == e).nonzero().squeeze(1) + part.start
                out = out.index_add(0, chosen, expert(h[chosen]) * gate[chosen, None])
        shares = F.one_hot(choice[:rows], EXPERTS).float().mean(dim=0)
        balance = EXPERTS * (shares * probabilities[:rows].mean(dim=0)).sum()
        return x + out, balance


class Classifier(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.inputs = nn.Linear(FEATURES, WIDTH)
        self.mixture = SwitchLayer()
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the slowed rank runs its layers (its experts too) on extra samples
        h, balance = self.mixture(self.inputs(grow(x, self.rank, self.opts)), len(x))
        return self.head(self.norm(h))[:len(x)], balance


def build(rank: int, opts: Options) -> Step:
    world = dist.get_world_size()
    torch.manual_seed(0)  # every rank starts from the same parameters
    model = Classifier(rank, opts)
    parameters = list(model.parameters())
    optimizer = torch.optim.Adam(parameters, lr=1e-3, fused=True)
    data = batches(clustered_samples(CLASSES, SAMPLES, FEATURES), rank, opts, BATCH)

    def step(_: int) -> None:
        features, labels = next(data)
        optimizer.zero_grad()
        logits, balance = model(features)
        (F.cross_entropy(logits, labels) + BALANCE * balance).backward()
        flat = flat_gradients(parameters)
        dist.reduce(flat, dst=ROOT)  # the sum, on rank 0 only
        dist.broadcast(flat, src=ROOT)  # rank 0's sum, on every rank
        unflatten_gradients(flat / world, parameters)
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
