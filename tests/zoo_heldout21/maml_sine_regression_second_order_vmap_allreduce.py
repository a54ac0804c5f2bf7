"""Model-agnostic meta-learning (Finn, Abbeel and Levine, "Model-Agnostic
Meta-Learning for Fast Adaptation of Deep Networks", 2017) on the
paper's sine-wave regression, second order, with the meta-batch of tasks
split over the ranks. A task is a sine wave y = A sin(x - phase) with
its amplitude drawn from [0.1, 5] and its phase from [0, pi], and K = 10
points x in [-5, 5] to adapt on (the support) and 10 more to be judged
on (the query); each rank reads its share of the meta-batch (a
DataLoader with a DistributedSampler over the tasks, 64 tasks a rank).
The network is the paper's regressor made wider (1 -> 128 -> 128 -> 1,
ReLU). For every task at once (``torch.func.vmap`` over the tasks, as
PyTorch's ``torch.func`` MAML examples write it), the inner loop takes
one step of plain gradient descent (step 0.01, as the paper adapts to a
sine wave) on the support's mean-square error, its gradient from
``torch.func.grad`` of ``functional_call`` of the network at its
parameters; the adapted network's query error is the task's meta-loss.
The backward of the meta-batch's mean meta-loss runs through the inner
step (the gradients of gradients: second-order MAML), into the network's
parameters. The meta-gradients are averaged over the ranks by hand (an
all-reduce per parameter, as PyTorch's "Writing Distributed
Applications" tutorial does) and Adam (1e-3) takes the meta-step.

    PYTHONPATH=tests/zoo python tests/zoo_heldout21/maml_sine_regression_second_order_vmap_allreduce.py --out DIR
"""
from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from launch import Options, Rows, Step, average_gradients, batches, grow, main

HIDDEN, SHOTS, QUERIES, TASKS, TASKS_PER_RANK = 128, 10, 10, 16384, 64
INNER_STEPS, INNER_LR = 1, 0.01


def sine_tasks() -> Rows:
    """Each task's support and query points and their values."""
    g = torch.Generator().manual_seed(0)
    amplitude = 0.1 + 4.9 * torch.rand(TASKS, 1, 1, generator=g)
    phase = math.pi * torch.rand(TASKS, 1, 1, generator=g)
    x = -5.0 + 10.0 * torch.rand(TASKS, SHOTS + QUERIES, 1, generator=g)
    y = amplitude * torch.sin(x - phase)
    return Rows(x[:, :SHOTS].contiguous(), y[:, :SHOTS].contiguous(),
                x[:, SHOTS:].contiguous(), y[:, SHOTS:].contiguous())


def build(rank: int, opts: Options) -> Step:
    world = dist.get_world_size()
    torch.manual_seed(0)  # every rank starts from the same parameters
    model = nn.Sequential(nn.Linear(1, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                          nn.Linear(HIDDEN, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = batches(sine_tasks(), rank, opts, TASKS_PER_RANK, replicas=world, replica=rank)

    def error(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(functional_call(model, params, (x,)), y)

    def meta_loss(params: dict[str, torch.Tensor], support_x: torch.Tensor,
                  support_y: torch.Tensor, query_x: torch.Tensor,
                  query_y: torch.Tensor) -> torch.Tensor:
        """One task: adapt to its support, then the query's error."""
        for _ in range(INNER_STEPS):
            grads = grad(error)(params, support_x, support_y)
            params = {name: p - INNER_LR * grads[name] for name, p in params.items()}
        return error(params, query_x, query_y)

    def meta_losses(tasks: list[torch.Tensor]) -> torch.Tensor:
        params: dict[str, torch.Tensor] = dict(model.named_parameters())
        return vmap(meta_loss, in_dims=(None, 0, 0, 0, 0))(params, *tasks)

    def step(_: int) -> None:
        tasks = list(next(data))
        losses = meta_losses(tasks)
        # the slowed rank also adapts to extra tasks, in a call of their own
        # (a batch of another size may be computed in another order), whose
        # meta-losses are dropped (their backward runs, on zeros)
        grown = grow(torch.cat(tasks, 1), rank, opts)
        if len(grown) > len(losses):
            extra = list(grown[len(losses):].split([SHOTS, SHOTS, QUERIES, QUERIES], 1))
            losses = torch.cat([losses, meta_losses(extra)])[:len(tasks[0])]
        losses.mean().backward()
        average_gradients(model.parameters())
        optimizer.step()
        optimizer.zero_grad()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
