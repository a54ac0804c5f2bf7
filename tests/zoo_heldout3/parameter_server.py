"""A synchronous parameter server written with point-to-point sends, after
PyTorch's parameter-server tutorial (there over RPC): every rank trains the
tutorial's small convolutional network on its share of the images; the
workers (ranks 1-3) each send their gradients, flattened into one tensor,
to the server (rank 0), which averages them with its own, steps SGD with
momentum and sends each worker the new parameters, flattened, to copy in.

    PYTHONPATH=tests/zoo python tests/zoo_heldout3/parameter_server.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from launch import Options, Rows, Step, batches, grow, main, receive, send

BATCH, IMAGES, SERVER = 32, 1024, 0


class Net(nn.Module):
    """The tutorial's network, narrower: two convolutions, a max-pool, two
    linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 16, 3), nn.Conv2d(16, 32, 3)
        self.fc1, self.fc2 = nn.Linear(32 * 12 * 12, 64), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = F.dropout(x, 0.25, self.training).flatten(1)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


PARAMETERS = sum(p.numel() for p in Net().parameters())  # floats in one message


def digits() -> Rows:
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (IMAGES,), generator=g)
    pixels = torch.rand(IMAGES, 1, 28, 28, generator=g)
    pixels[:, 0, labels, :] += 1.0  # a class shows as a bright row
    return Rows(pixels, labels)


def gradients(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def serve(model: nn.Module, optimizer: torch.optim.Optimizer, opts: Options) -> None:
    """Rank 0: receive each worker's gradients, average, step, send back."""
    workers = range(1, dist.get_world_size())
    total = gradients(model)
    for worker in workers:
        total += receive(torch.empty(PARAMETERS), worker, opts)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    vector_to_parameters(total / dist.get_world_size(), grads)  # the average, in place
    optimizer.step()
    flat = parameters_to_vector(model.parameters()).detach()
    for work in [send(flat, worker) for worker in workers]:
        work.wait()


def work_for_server(model: nn.Module, opts: Options) -> None:
    """A worker: send its gradients, copy in the parameters the server sends."""
    sent = send(gradients(model), SERVER)
    flat = receive(torch.empty(PARAMETERS), SERVER, opts)
    sent.wait()
    with torch.no_grad():
        vector_to_parameters(flat, model.parameters())


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)  # every rank starts from the server's parameters
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = batches(digits(), rank, opts, BATCH)

    def step(_: int) -> None:
        x, labels = next(data)
        model.zero_grad()
        F.nll_loss(model(grow(x, rank, opts))[:len(x)], labels).backward()
        if rank == SERVER:
            serve(model, optimizer, opts)
        else:
            work_for_server(model, opts)
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
