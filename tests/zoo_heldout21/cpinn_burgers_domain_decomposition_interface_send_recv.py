"""A physics-informed neural network (Raissi, Perdikaris and Karniadakis,
"Physics-informed neural networks", 2019) for the viscous Burgers
equation u_t + u u_x = (0.01 / pi) u_xx on x in [-1, 1], t in [0, 1],
with u(0, x) = -sin(pi x) and u(t, -1) = u(t, 1) = 0, its domain
decomposed over the ranks as conservative PINNs decompose it (Jagtap,
Kharazmi and Karniadakis, "Conservative physics-informed neural networks
on discrete domains for conservation laws", 2020) and trained in parallel
as Shukla, Jagtap and Karniadakis train them ("Parallel physics-informed
neural networks via domain decomposition", 2021): rank r solves the
strip of x from -1 + r / 2 to -1 + (r + 1) / 2 with a network of its own
(an MLP from (t, x) to u: three hidden layers of 64, tanh), on
collocation points of its strip (a DataLoader over the rank's own
points), the initial condition on its part of t = 0, and the boundary
condition where its strip meets x = -1 or x = 1. The PDE's residual
takes u_t, u_x and u_xx from ``torch.autograd.grad`` with
``create_graph=True``, so the backward runs through the derivatives
(double backward). At the interface points the strips share (1,024
times on each inner boundary), each rank computes its u and its flux
u^2 / 2 - (0.01 / pi) u_x and sends them to the neighbour across that
interface (``dist.isend`` and ``dist.irecv``, the point-to-point of
PyTorch's "Writing Distributed Applications" tutorial), and adds
cPINN's interface terms with the neighbour's values held fixed: its u
against the mean of both, its flux against the neighbour's. No gradient
or parameter is exchanged; every rank steps Adam on its own network.

    PYTHONPATH=tests/zoo python tests/zoo_heldout21/cpinn_burgers_domain_decomposition_interface_send_recv.py --out DIR
"""
from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
from torch import nn

from launch import Options, Rows, Step, batches, grow, main, receive, send

NU = 0.01 / math.pi
WIDTH, HIDDEN_LAYERS = 64, 3
POINTS, BATCH, INITIAL, BOUNDARY, INTERFACE = 16384, 1024, 256, 256, 1024
INTERFACE_WEIGHT = 20.0
# floats in one message: u and the flux at every interface point
MESSAGE = 2 * INTERFACE


def strip(rank: int, world: int) -> tuple[float, float]:
    return -1.0 + 2.0 * rank / world, -1.0 + 2.0 * (rank + 1) / world


def collocation(rank: int, world: int) -> Rows:
    """The rank's collocation points, (t, x) uniform over its strip."""
    g = torch.Generator().manual_seed(rank)
    low, high = strip(rank, world)
    return Rows(torch.stack([torch.rand(POINTS, generator=g),
                             low + (high - low) * torch.rand(POINTS, generator=g)], 1))


class Network(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        widths = (2, *[WIDTH] * HIDDEN_LAYERS)
        layers: list[nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Linear(a, b), nn.Tanh()]
        self.body = nn.Sequential(*layers, nn.Linear(WIDTH, 1))

    def forward(self, tx: torch.Tensor) -> torch.Tensor:
        return self.body(tx).squeeze(1)


def derivatives(net: Network, tx: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """u, u_t and u_x at the points ``tx``, differentiable again."""
    tx = tx.detach().requires_grad_()
    u = net(tx)
    (du,) = torch.autograd.grad(u.sum(), tx, create_graph=True)
    return u, du[:, 0], du[:, 1], tx


def residual(net: Network, tx: torch.Tensor) -> torch.Tensor:
    """u_t + u u_x - nu u_xx at the points ``tx``."""
    u, u_t, u_x, leaf = derivatives(net, tx)
    (du_x,) = torch.autograd.grad(u_x.sum(), leaf, create_graph=True)
    return u_t + u * u_x - NU * du_x[:, 1]


def interface_values(net: Network, tx: torch.Tensor) -> torch.Tensor:
    """u and the flux u^2 / 2 - nu u_x at the interface points ``tx``."""
    u, _, u_x, _ = derivatives(net, tx)
    return torch.stack([u, u * u / 2 - NU * u_x])


def build(rank: int, opts: Options) -> Step:
    world = dist.get_world_size()
    low, high = strip(rank, world)
    torch.manual_seed(rank)  # each strip its own network
    net = Network()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    data = batches(collocation(rank, world), rank, opts, BATCH, replicas=1, replica=0)
    g = torch.Generator().manual_seed(world + rank)
    x0 = low + (high - low) * torch.rand(INITIAL, generator=g)
    initial = torch.stack([torch.zeros(INITIAL), x0], 1)
    u0 = -torch.sin(math.pi * x0)
    # the outer boundaries (rank 0's x = -1, the last rank's x = 1)
    walls = [x for x, mine in ((-1.0, rank == 0), (1.0, rank == world - 1)) if mine]
    boundary = [torch.stack([torch.rand(BOUNDARY, generator=g), torch.full((BOUNDARY,), x)], 1)
                for x in walls]
    # the inner boundaries: each with its neighbour across it, the same times on both sides
    times = torch.linspace(0.0, 1.0, INTERFACE)
    sides = [(n, torch.stack([times, torch.full((INTERFACE,), x)], 1))
             for n, x in ((rank - 1, low), (rank + 1, high)) if 0 <= n < world]
    sent: list[tuple[dist.Work, torch.Tensor]] = []

    def with_extra(points: torch.Tensor) -> torch.Tensor:
        """The residual at ``points``; the slowed rank also computes it at extra
        points, in a call of their own (a batch of another size may be
        computed in another order), whose residuals are dropped (their
        backward runs, on zeros)."""
        grown = grow(points, rank, opts)
        r = residual(net, points)
        if len(grown) > len(points):
            r = torch.cat([r, residual(net, grown[len(points):])])[:len(points)]
        return r

    def step(_: int) -> None:
        (points,) = next(data)
        mine = []
        for neighbour, tx in sides:
            values = interface_values(net, tx)
            message = values.detach().contiguous()
            sent.append((send(message, neighbour), message))
            mine.append(values)
        loss = with_extra(points).square().mean()
        loss = loss + (net(initial) - u0).square().mean()
        for tx in boundary:
            loss = loss + net(tx).square().mean()
        for (neighbour, _points), values in zip(sides, mine):
            theirs = receive(torch.empty(2, INTERFACE), neighbour, opts)
            loss = loss + INTERFACE_WEIGHT * (
                (values[0] - (values[0] + theirs[0]) / 2).square().mean()
                + (values[1] - theirs[1]).square().mean())
        for work, _buffer in sent:
            work.wait()
        sent.clear()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
