"""A graph convolutional network under DDP, as users write message passing
in plain PyTorch after PyTorch Geometric's GCN example: each layer
transforms the node features (a linear layer), gathers them along the
edges, weights them by the symmetric degree normalisation and sums them
into each target node with ``index_add_``; two layers (as the example
has), a mean over each graph's nodes and a linear classifier. Batches of small graphs (their nodes
stacked, their edges offset) a DataLoader reads with a DistributedSampler;
Adam with weight decay.

    PYTHONPATH=tests/zoo python tests/zoo_heldout3/ddp_gcn.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

FEATURES, HIDDEN, CLASSES, NODES, EDGES, GRAPHS, BATCH = 128, 512, 4, 32, 96, 1024, 16


class GCNConv(nn.Module):
    """One message-passing layer: x' = D^-1/2 (A + I) D^-1/2 x W."""

    def __init__(self, rank: int, opts: Options, inputs: int, outputs: int) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.linear = nn.Linear(inputs, outputs)

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        # the slowed rank transforms extra nodes (no edges reach them)
        h = self.linear(grow(x, self.rank, self.opts))[:len(x)]
        loops = torch.arange(len(x))
        src, dst = torch.cat([edges[0], loops]), torch.cat([edges[1], loops])
        degree = torch.zeros(len(x)).index_add_(0, dst, torch.ones(len(dst)))
        norm = (degree[src] * degree[dst]).rsqrt().unsqueeze(1)
        return torch.zeros_like(h).index_add_(0, dst, h[src] * norm)


class GCN(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        sizes = [FEATURES, HIDDEN, HIDDEN]
        self.convs = nn.ModuleList(GCNConv(rank, opts, a, b) for a, b in zip(sizes, sizes[1:]))
        self.classifier = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor, edges: torch.Tensor, graphs: int) -> torch.Tensor:
        for conv in self.convs:
            x = F.dropout(F.relu(conv(x, edges)), 0.2, self.training)
        return self.classifier(x.view(graphs, NODES, HIDDEN).mean(1))


def graphs() -> Rows:
    """Random graphs whose class is set by which quarter of the features
    their nodes carry most of."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, CLASSES, (GRAPHS,), generator=g)
    x = torch.rand(GRAPHS, NODES, FEATURES, generator=g)
    x.view(GRAPHS, NODES, CLASSES, -1)[torch.arange(GRAPHS), :, labels] += 0.5
    return Rows(x, torch.randint(0, NODES, (GRAPHS, 2, EDGES), generator=g), labels)


def stacked(x: torch.Tensor, edges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of graphs as one graph: nodes stacked, edges offset."""
    offsets = (torch.arange(len(x)) * NODES).view(-1, 1, 1)
    return x.reshape(-1, FEATURES), (edges + offsets).permute(1, 0, 2).reshape(2, -1)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(GCN(rank, opts))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=5e-4)
    data = batches(graphs(), rank, opts, BATCH)

    def step(_: int) -> None:
        x, edges, labels = next(data)
        optimizer.zero_grad()
        F.cross_entropy(model(*stacked(x, edges), len(x)), labels).backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
