"""Split learning in its U-shaped configuration, without sharing labels
(Vepakomma, Gupta, Swedish and Raskar, "Split learning for health:
Distributed deep learning without sharing raw patient data", 2018), with
the clients' parts averaged as SplitFed averages them (Thapa, Arachchige,
Camtepe and Sun, "SplitFed: When Federated Learning Meets Split
Learning", 2022): ranks 1 to 3 are clients, each holding its own share of
the data and labels (a DataLoader with a DistributedSampler over the
three clients) and the network's first layers (two linear layers, ReLU
between and after) and last layers (LayerNorm, a linear layer, ReLU and
the classifier); rank 0 is the server, which reads nothing and holds the
middle of the network (a pre-norm residual feed-forward block), which it
runs on every client's batch. Each step every client sends the server
its first layer's activations (the "smashed data"), the server runs its
blocks on all three clients' at once and sends each client its share of
the outputs; each client computes its loss from them, runs its backward
to them and sends the server their gradients, and the server runs its
backward and sends each client the gradients of the activations it had
sent, with which the client finishes its own backward; all with the
point-to-point of PyTorch's "Writing Distributed Applications" tutorial
(``dist.isend`` and ``dist.irecv``). The server steps Adam on the mean of
the clients' gradients, each client Adam on its own; every second step
the clients average their parts' parameters (``dist.all_reduce`` in a
process group of the three clients, ``dist.new_group``), as SplitFed's
federated server averages the client-side models after each round. The
task: classify feature vectors around one of four centres per class (ten
classes).

    PYTHONPATH=tests/zoo python tests/zoo_heldout20/splitfed_u_shaped_server_send_recv.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Step, batches, grow, main, receive, send
from job_parts import FeedForwardBlock, clustered_samples

FEATURES, WIDTH, HIDDEN, CLASSES, SAMPLES, BATCH = 256, 256, 1024, 10, 16384, 128
SERVER, CLIENTS, ROUND = 0, (1, 2, 3), 2  # a round: the steps between two averagings
# floats in one message: a client's batch of activations (or their gradients)
MESSAGE = BATCH * WIDTH


def with_extra(layers: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rank: int,
               opts: Options) -> torch.Tensor:
    """``layers(x)``; the slowed rank also runs ``layers`` on extra samples,
    in a call of their own (a batch of another size may be computed in
    another order), whose outputs are dropped (their backward runs, on
    zeros)."""
    grown = grow(x, rank, opts)
    y = layers(x)
    if len(grown) > len(x):
        y = torch.cat([y, layers(grown[len(x):])])[:len(x)]
    return y


class ClientPart(nn.Module):
    """The layers a client keeps: the first, and the last ones."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(),
                                   nn.Linear(HIDDEN, WIDTH), nn.ReLU())
        self.last = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                                  nn.Linear(WIDTH, CLASSES))


def build(rank: int, opts: Options) -> Step:
    assert dist.get_world_size() == 1 + len(CLIENTS)
    clients = dist.new_group(list(CLIENTS))  # every rank creates it
    if rank == SERVER:
        return server(rank, opts)
    return client(rank, opts, clients)


def server(rank: int, opts: Options) -> Step:
    torch.manual_seed(1)
    blocks = FeedForwardBlock(WIDTH, 2, F.gelu)
    optimizer = torch.optim.Adam(blocks.parameters(), lr=1e-3)
    sent: list[tuple[dist.Work, torch.Tensor]] = []

    def pass_on(x: torch.Tensor, dst: int) -> None:
        x = x.detach().contiguous()
        sent.append((send(x, dst), x))

    def step(_: int) -> None:
        smashed = [receive(torch.empty(BATCH, WIDTH), c, opts).requires_grad_()
                   for c in CLIENTS]
        outputs = with_extra(blocks, torch.cat(smashed), rank, opts)
        for c, part in zip(CLIENTS, outputs.split(BATCH)):
            pass_on(part, c)
        grads = [receive(torch.empty(BATCH, WIDTH), c, opts) for c in CLIENTS]
        outputs.backward(torch.cat(grads))
        for c, x in zip(CLIENTS, smashed):
            assert x.grad is not None
            pass_on(x.grad, c)
        for p in blocks.parameters():  # the mean over the clients
            assert p.grad is not None
            p.grad /= len(CLIENTS)
        optimizer.step()
        optimizer.zero_grad()
        for work, _buffer in sent:
            work.wait()
        sent.clear()
    return step


def client(rank: int, opts: Options, clients: dist.ProcessGroup) -> Step:
    torch.manual_seed(0)  # every client starts from the same parameters
    part = ClientPart()
    parameters = list(part.parameters())
    optimizer = torch.optim.Adam(parameters, lr=1e-3)
    data = batches(clustered_samples(CLASSES, SAMPLES, FEATURES), rank, opts, BATCH,
                   replicas=len(CLIENTS), replica=CLIENTS.index(rank))
    sent: list[tuple[dist.Work, torch.Tensor]] = []

    def pass_on(x: torch.Tensor) -> None:
        x = x.detach().contiguous()
        sent.append((send(x, SERVER), x))

    def step(i: int) -> None:
        features, labels = next(data)
        smashed = with_extra(part.first, features, rank, opts)
        pass_on(smashed)
        returned = receive(torch.empty(BATCH, WIDTH), SERVER, opts).requires_grad_()
        loss = F.cross_entropy(with_extra(part.last, returned, rank, opts), labels)
        loss.backward()
        assert returned.grad is not None
        pass_on(returned.grad)
        smashed.backward(receive(torch.empty(BATCH, WIDTH), SERVER, opts))
        optimizer.step()
        optimizer.zero_grad()
        if i % ROUND == ROUND - 1:
            with torch.no_grad():
                flat = torch.cat([p.flatten() for p in parameters])
                dist.all_reduce(flat, group=clients)
                flat /= len(CLIENTS)
                for p, values in zip(parameters, flat.split([p.numel() for p in parameters])):
                    p.copy_(values.view_as(p))
        for work, _buffer in sent:
            work.wait()
        sent.clear()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
