"""Data parallelism whose gradients are averaged by a hand-written
all-reduce over two binary trees, as NCCL's double binary trees do
(Sanders, Speck and Träff, "Two-tree algorithms for full bandwidth
broadcast, reduction and scan", 2009; NCCL 2.4's tree algorithm, its
trees laid out by ``ncclGetBtree`` and its mirror): the first tree is
rooted at rank 0, whose child is rank 2, whose children are ranks 1 and
3; the second is its mirror (rank r in the place of rank 3 - r), rooted
at rank 3, whose child is rank 1, whose children are ranks 2 and 0. Every
rank is a leaf in one tree and an inner node (or the root) in the other.
After the backward each rank joins its gradients into one flat buffer and
cuts it in two halves, the first reduced and broadcast over the first
tree, the second over the second, both at once: a leaf sends its half to
its parent; an inner node adds its children's halves to its own (in the
order of its children) and sends the sum up; the root's sum is the whole
sum, which goes back down the same tree, each node passing on what it
received from its parent. All with the point-to-point of PyTorch's
"Writing Distributed Applications" tutorial (``dist.isend`` and
``dist.irecv``). Every rank so holds the same sums, bit for bit, divided
by the world size and copied back into the gradients; the gradients'
norm is clipped to 1 and AdamW steps them, as the MLP-Mixer paper
trains. The model: an MLP-Mixer (Tolstikhin et al., "MLP-Mixer: An
all-MLP Architecture for Vision", 2021) on 16x16 single-channel images
cut in 16 patches of 4x4 (a per-patch linear embedding to 128 channels,
two mixer layers, each a pre-norm token-mixing MLP across the 16 patches
and a pre-norm channel-mixing MLP, GELU, residuals; a final LayerNorm,
global average pooling and the classifier). Each rank reads its share of
the images (a DataLoader with a DistributedSampler).

    PYTHONPATH=tests/zoo python tests/zoo_heldout21/double_binary_tree_allreduce_mixer_send_recv.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Rows, Step, batches, grow, main, receive, send
from job_parts import clustered_samples, flat_gradients, unflatten_gradients

SIDE, PATCH, CHANNELS, TOKEN_HIDDEN, CHANNEL_HIDDEN, LAYERS = 16, 4, 128, 64, 256, 2
CLASSES, IMAGES, BATCH = 10, 16384, 128
TOKENS, PIXELS = (SIDE // PATCH) ** 2, PATCH * PATCH
# each tree: every rank's parent (None at the root) and children, in order
PARENTS = ({0: None, 2: 0, 1: 2, 3: 2}, {3: None, 1: 3, 2: 1, 0: 1})
CHILDREN = ({0: (2,), 2: (1, 3), 1: (), 3: ()}, {3: (1,), 1: (2, 0), 2: (), 0: ()})


def mlp(width: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


class MixerLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.token_norm, self.channel_norm = nn.LayerNorm(CHANNELS), nn.LayerNorm(CHANNELS)
        self.token_mixing = mlp(TOKENS, TOKEN_HIDDEN)
        self.channel_mixing = mlp(CHANNELS, CHANNEL_HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, tokens, channels)
        x = x + self.token_mixing(self.token_norm(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mixing(self.channel_norm(x))


class Mixer(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.embed = nn.Linear(PIXELS, CHANNELS)
        self.layers = nn.Sequential(*(MixerLayer() for _ in range(LAYERS)))
        self.norm = nn.LayerNorm(CHANNELS)
        self.head = nn.Linear(CHANNELS, CLASSES)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        b = len(images)
        patches = images.view(b, SIDE // PATCH, PATCH, SIDE // PATCH, PATCH)
        patches = patches.permute(0, 1, 3, 2, 4).reshape(b, TOKENS, PIXELS)
        return self.head(self.norm(self.layers(self.embed(patches))).mean(1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # the slowed rank also classifies extra images, in a call of their own
        # (a batch of another size may be computed in another order), whose
        # logits are dropped (their backward runs, on zeros)
        grown = grow(images, self.rank, self.opts)
        y = self.logits(images)
        if len(grown) > len(images):
            y = torch.cat([y, self.logits(grown[len(images):])])[:len(images)]
        return y


def parameter_count() -> int:
    per_layer = 2 * 2 * CHANNELS + (2 * TOKENS * TOKEN_HIDDEN + TOKEN_HIDDEN + TOKENS) + (
        2 * CHANNELS * CHANNEL_HIDDEN + CHANNEL_HIDDEN + CHANNELS)
    return (PIXELS * CHANNELS + CHANNELS + LAYERS * per_layer + 2 * CHANNELS
            + CHANNELS * CLASSES + CLASSES)


# floats in one message: half the model's gradients, flattened (or their sums)
MESSAGE = parameter_count() // 2


def double_tree_all_reduce(flat: torch.Tensor, rank: int, opts: Options) -> torch.Tensor:
    """The sum of every rank's ``flat``: its first half reduced to the first
    tree's root and broadcast down that tree, its second half over the
    second tree, at once."""
    halves = list(flat.split([MESSAGE, len(flat) - MESSAGE]))
    sent: list[tuple[dist.Work, torch.Tensor]] = []

    def pass_on(x: torch.Tensor, dst: int) -> None:
        x = x.contiguous()
        sent.append((send(x, dst), x))

    leaf = next(t for t in range(2) if not CHILDREN[t][rank])
    inner = 1 - leaf
    # reduce: as a leaf, the half goes up at once; as an inner node, the
    # children's halves are added to the node's own and the sum goes up
    parent = PARENTS[leaf][rank]
    assert parent is not None
    pass_on(halves[leaf], parent)
    total = halves[inner].clone()
    for child in CHILDREN[inner][rank]:
        total += receive(torch.empty_like(total), child, opts)
    above = PARENTS[inner][rank]
    if above is not None:
        pass_on(total, above)
        # broadcast: the root's sum comes back down the same tree
        total = receive(torch.empty_like(total), above, opts)
    for child in CHILDREN[inner][rank]:
        pass_on(total, child)
    summed = [torch.empty(0), torch.empty(0)]
    summed[inner] = total
    summed[leaf] = receive(torch.empty_like(halves[leaf]), parent, opts)
    for work, _buffer in sent:
        work.wait()
    return torch.cat(summed)


def images() -> Rows:
    samples, labels = clustered_samples(CLASSES, IMAGES, SIDE * SIDE).tensors
    return Rows(samples.view(IMAGES, 1, SIDE, SIDE), labels)


def build(rank: int, opts: Options) -> Step:
    world = dist.get_world_size()
    assert world == 4  # the trees are laid out for four ranks
    torch.manual_seed(0)  # every rank starts from the same parameters
    model = Mixer(rank, opts)
    parameters = list(model.parameters())
    assert sum(p.numel() for p in parameters) == parameter_count()
    optimizer = torch.optim.AdamW(parameters, lr=1e-3, weight_decay=0.05)
    data = batches(images(), rank, opts, BATCH)

    def step(_: int) -> None:
        x, labels = next(data)
        F.cross_entropy(model(x), labels).backward()
        flat = double_tree_all_reduce(flat_gradients(parameters), rank, opts)
        unflatten_gradients(flat / world, parameters)
        nn.utils.clip_grad_norm_(parameters, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
