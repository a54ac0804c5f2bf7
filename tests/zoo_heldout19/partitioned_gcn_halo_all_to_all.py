"""Full-graph training of a graph convolutional network on one large graph
partitioned over the ranks, as distributed GNN systems (DistGNN, CAGNET,
PipeGCN) train graphs too large for one machine: each rank owns a
contiguous quarter of the nodes, their features, labels and incoming
edges; before each layer's aggregation every rank sends the transformed
features of its nodes that other partitions' edges read (their halo
nodes) and receives its own halo in one exchange
(``torch.distributed.nn.functional.all_to_all_single``, whose backward
sends the halo's gradients back the same way), then sums the messages
along its edges into its own nodes with ``index_add_``, weighted by the
symmetric degree normalisation (x' = D^-1/2 (A + I) D^-1/2 x W). Two layers
(ReLU between) and a linear classifier of each node; the loss is the
cross-entropy over the rank's training nodes, the parameters are
replicated and their gradients averaged by hand after the backward
(``dist.all_reduce``, as the "Writing Distributed Applications" tutorial
does), then Adam with weight decay. The graph: nodes in classes whose
features lie around one of four centres per class, most edges between
nodes of one partition and a share across partitions (the halo). It is
full-batch: the job has no data loader of its own.

    PYTHONPATH=tests/zoo python tests/zoo_heldout19/partitioned_gcn_halo_all_to_all.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as distF
import torch.nn.functional as F
from torch import nn

from launch import Options, Step, average_gradients, grow, main
from job_parts import clustered_samples

FEATURES, HIDDEN, CLASSES = 64, 128, 8
NODES, DEGREE, CROSS_SHARE, TRAIN_SHARE = 4096, 8, 0.1, 0.5


class Partition:
    """One rank's part of the graph: its nodes, its incoming edges (their
    sources indexed into its own nodes, then its halo), which of its nodes
    each other rank reads, and the normalisation of each edge."""

    def __init__(self, rank: int, world: int) -> None:
        g = torch.Generator().manual_seed(0)  # every rank draws the same graph
        owned = NODES // world
        targets = torch.arange(NODES).repeat_interleave(DEGREE)
        local = (targets // owned) * owned + torch.randint(0, owned, (len(targets),), generator=g)
        anywhere = torch.randint(0, NODES, (len(targets),), generator=g)
        sources = torch.where(torch.rand(len(targets), generator=g) < CROSS_SHARE, anywhere,
                              local)
        loops = torch.arange(NODES)  # A + I
        targets, sources = torch.cat([targets, loops]), torch.cat([sources, loops])
        degree = torch.zeros(NODES).index_add_(0, targets, torch.ones(len(targets)))
        weight = (degree[sources] * degree[targets]).rsqrt()
        features, labels = clustered_samples(CLASSES, NODES, FEATURES).tensors
        train = torch.rand(NODES, generator=g) < TRAIN_SHARE

        def read(reader: int, holder: int) -> torch.Tensor:
            """The nodes of ``holder`` that ``reader``'s edges read (global ids)."""
            into = targets // owned == reader
            from_holder = sources[into][sources[into] // owned == holder]
            return torch.unique(from_holder)

        first, last = rank * owned, (rank + 1) * owned
        # what this rank receives (from each other rank, in rank order) and sends
        needed = [read(rank, r) if r != rank else torch.empty(0, dtype=torch.long)
                  for r in range(world)]
        self.send_index = [read(r, rank) - first if r != rank else torch.empty(0, dtype=torch.long)
                           for r in range(world)]
        self.recv_sizes = [len(n) for n in needed]
        self.send_sizes = [len(i) for i in self.send_index]
        halo = torch.cat(needed)
        position = torch.full((NODES,), -1, dtype=torch.long)
        position[first:last] = torch.arange(owned)
        position[halo] = owned + torch.arange(len(halo))
        mine = targets // owned == rank
        self.targets, self.sources = targets[mine] - first, position[sources[mine]]
        self.weight = weight[mine].unsqueeze(1)
        self.owned = owned
        self.features, self.labels = features[first:last], labels[first:last]
        self.train = train[first:last]
        self.training_nodes = int(train.sum())  # every rank's together

    def exchange(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (one row per owned node) with the halo's rows after it."""
        sent = x[torch.cat(self.send_index)]
        halo = distF.all_to_all_single(x.new_empty(sum(self.recv_sizes), x.shape[1]), sent,
                                       self.recv_sizes, self.send_sizes)
        return torch.cat([x, halo])

    def aggregate(self, x: torch.Tensor) -> torch.Tensor:
        """Each owned node's weighted sum of its incoming messages."""
        messages = self.exchange(x)[self.sources] * self.weight
        return x.new_zeros(self.owned, x.shape[1]).index_add_(0, self.targets, messages)


class GCN(nn.Module):
    def __init__(self, partition: Partition, rank: int, opts: Options) -> None:
        super().__init__()
        self.partition, self.rank, self.opts = partition, rank, opts
        self.conv1, self.conv2 = nn.Linear(FEATURES, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.classifier = nn.Linear(HIDDEN, CLASSES)

    def transform(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``layer(x)``; the slowed rank also transforms extra rows, in a
        call of their own (a batch of another size may be computed in
        another order), whose outputs are dropped (their backward runs,
        on zeros)."""
        grown = grow(x, self.rank, self.opts)
        y = layer(x)
        if len(grown) > len(x):
            y = torch.cat([y, layer(grown[len(x):])])[:len(x)]
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.partition.aggregate(self.transform(self.conv1, x)))
        x = F.relu(self.partition.aggregate(self.transform(self.conv2, x)))
        return self.transform(self.classifier, x)


def build(rank: int, opts: Options) -> Step:
    partition = Partition(rank, dist.get_world_size())
    torch.manual_seed(0)  # every rank starts from the same parameters
    model = GCN(partition, rank, opts)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=5e-4)
    train = partition.train

    def step(_: int) -> None:
        logits = model(partition.features)
        # the mean over every rank's training nodes: each rank's sum over the global count
        loss = F.cross_entropy(logits[train], partition.labels[train], reduction="sum")
        (loss * dist.get_world_size() / partition.training_nodes).backward()
        average_gradients(model.parameters())
        optimizer.step()
        optimizer.zero_grad()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0]))
