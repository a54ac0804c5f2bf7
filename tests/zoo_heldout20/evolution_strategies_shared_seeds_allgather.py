"""Evolution strategies as OpenAI's scalable ES trains a network (Salimans,
Ho, Chen, Sidor and Sutskever, "Evolution Strategies as a Scalable
Alternative to Reinforcement Learning", 2017): no backward pass at all.
Every rank holds the same parameters and, each step, draws its own
perturbations of them (Gaussian noise from a generator seeded by the step
and the rank, 16 directions a rank, each tried both ways: mirrored
sampling) and evaluates the loss of every perturbed network on the batch
(one batched forward, ``torch.func.vmap`` over ``functional_call`` of the
model, under ``no_grad``). The ranks then exchange only those losses
(``dist.all_gather_single`` of 32 floats each), as the paper's
workers share scalar returns and the seeds that made them: every rank
turns all 128 losses into centred ranks (fitness shaping), draws every
rank's noise again from its seed and sums the directions weighted by
their rank differences into the same gradient estimate, which it hands
to Adam (with weight decay, as the paper does) as the parameters'
gradients; so the replicas stay equal without a parameter or a gradient
ever being sent. The model: an MLP classifier (64 -> 128 -> 128 -> 10,
Tanh) on feature vectors around one of four centres per class; every
rank reads the same batches (a DataLoader over the whole data set), as
the paper's workers evaluate one objective.

    PYTHONPATH=tests/zoo python tests/zoo_heldout20/evolution_strategies_shared_seeds_allgather.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from launch import Options, Step, batches, grow, main
from job_parts import clustered_samples

FEATURES, HIDDEN, CLASSES, SAMPLES, BATCH = 64, 128, 10, 16384, 256
DIRECTIONS, SIGMA = 16, 0.02  # mirrored directions a rank draws, the noise's scale


def build(rank: int, opts: Options) -> Step:
    world = dist.get_world_size()
    torch.manual_seed(0)  # every rank starts from the same parameters
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
                          nn.Tanh(), nn.Linear(HIDDEN, CLASSES))
    names = [name for name, _ in model.named_parameters()]
    parameters = [p for _, p in model.named_parameters()]
    sizes = [p.numel() for p in parameters]
    count = sum(sizes)
    optimizer = torch.optim.Adam(parameters, lr=1e-2, weight_decay=5e-3)
    data = batches(clustered_samples(CLASSES, SAMPLES, FEATURES), rank, opts, BATCH,
                   replicas=1, replica=0)

    def noise(step: int, owner: int) -> torch.Tensor:
        """The directions rank ``owner`` draws at ``step`` (any rank can draw them again)."""
        seed = 1_000_003 * step + owner
        return torch.randn(DIRECTIONS, count, generator=torch.Generator().manual_seed(seed))

    def population(flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Flattened parameter vectors (one a row) as ``functional_call``'s dictionary."""
        return {name: part.view(-1, *p.shape) for name, p, part in
                zip(names, parameters, flat.split(sizes, dim=1))}

    def losses(members: dict[str, torch.Tensor], x: torch.Tensor,
               labels: torch.Tensor) -> torch.Tensor:
        def one(values: dict[str, torch.Tensor]) -> torch.Tensor:
            return F.cross_entropy(functional_call(model, values, (x,)), labels)
        return vmap(one)(members)

    @torch.no_grad()
    def step(i: int) -> None:
        x, labels = next(data)
        centre = torch.cat([p.flatten() for p in parameters])
        epsilon = noise(i, rank)
        members = population(torch.cat([centre + SIGMA * epsilon, centre - SIGMA * epsilon]))
        mine = losses(members, x, labels)
        # the slowed rank also evaluates the population on extra samples, in a
        # call of their own (a batch of another size may be computed in another
        # order), and drops the losses
        grown = grow(x, rank, opts)
        if len(grown) > len(x):
            extra = grown[len(x):]
            losses(members, extra, torch.zeros(len(extra), dtype=torch.long))
        everyone = torch.empty(world * 2 * DIRECTIONS)
        dist.all_gather_single(everyone, mine)
        # centred ranks in [-0.5, 0.5] of all the losses (ties broken by position)
        shaped = torch.empty_like(everyone)
        shaped[everyone.argsort(stable=True)] = torch.linspace(-0.5, 0.5, len(everyone))
        shaped = shaped.view(world, 2, DIRECTIONS)
        weights = (shaped[:, 0] - shaped[:, 1]).flatten()  # per direction: loss up minus down
        directions = torch.cat([noise(i, owner) for owner in range(world)])
        estimate = weights @ directions / (len(weights) * SIGMA)
        for p, part in zip(parameters, estimate.split(sizes)):
            p.grad = part.view_as(p).clone()
        optimizer.step()
        optimizer.zero_grad()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
