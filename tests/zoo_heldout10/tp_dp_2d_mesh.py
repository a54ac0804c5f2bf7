"""Two-dimensional parallelism, tensor parallel within pairs of ranks and
data parallel across the pairs, as PyTorch's tensor-parallel tutorial
lays out a 2-D ``DeviceMesh`` (mesh dimensions ``dp`` and ``tp``: ranks 0
and 1 are one tensor-parallel pair, 2 and 3 the other), on a small
Transformer language model: token and position embeddings, one pre-norm
block (causal multi-head self-attention, then an MLP), a final LayerNorm
and the language-model head. ``parallelize_module`` on the ``tp``
dimension plans the block as the tutorial does: ``ColwiseParallel`` for
the query, key and value projections (each rank half of the heads, its
attention local), ``RowwiseParallel`` for the attention's output
projection, ``ColwiseParallel`` then ``RowwiseParallel`` for the MLP's up
and down projections (each rank half of the hidden units), and
``ColwiseParallel`` for the head, its logits gathered (``Replicate``).
After backward each pair averages its gradients with the other pair's
(``all_reduce`` of each local shard on the mesh's ``dp`` process group),
then AdamW steps. The two ranks of a pair read the same sequences, the
pair's share of them (a DataLoader with a DistributedSampler).

The slowed rank's projections and attention run on extra sequences of its
own: hooks on each parallel linear layer, after the plan's own, add the
rows to the layer's local input and take them off its local output before
the plan's collectives see it.

    PYTHONPATH=tests/zoo python tests/zoo_heldout10/tp_dp_2d_mesh.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

from launch import Options, Rows, Step, batches, grow, main
from job_parts import ExtraRows, markov_sequences

VOCAB, CONTEXT, WIDTH, HEADS = 512, 32, 128, 4
PAIRS, BATCH, SEQUENCES = 2, 16, 2048


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = HEADS  # the plan halves it on each rank of a pair
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(3))
        self.out = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor, rank: int, opts: Options) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (p(x).view(batch, length, self.heads, -1).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        # the slowed rank attends over extra sequences too
        q, k, v = (grow(t, rank, opts) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:batch]
        return self.out(y.transpose(1, 2).reshape(batch, length, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
        self.down = nn.Linear(4 * WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class LanguageModel(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.norm1, self.attention = nn.LayerNorm(WIDTH), Attention()
        self.norm2, self.mlp = nn.LayerNorm(WIDTH), FeedForward()
        self.norm3, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1]))
        x = x + self.attention(self.norm1(x), self.rank, self.opts)
        x = x + self.mlp(self.norm2(x))
        return self.head(self.norm3(x))


def parallelize(model: LanguageModel, mesh: DeviceMesh) -> None:
    """The tutorial's plan for a block: attention heads and MLP units split
    over the pair, the logits gathered."""
    parallelize_module(model, mesh, {
        "attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(),
        "attention.v": ColwiseParallel(), "attention.out": RowwiseParallel(),
        "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Replicate())})
    model.attention.heads = HEADS // mesh.size()


def sequences() -> Rows:
    return markov_sequences(VOCAB, SEQUENCES, CONTEXT)


def build(rank: int, opts: Options) -> Step:
    mesh = init_device_mesh("cpu", (PAIRS, dist.get_world_size() // PAIRS),
                            mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # every rank starts from the same parameters, then keeps its share
    model = LanguageModel(rank, opts)
    parallelize(model, mesh["tp"])
    if rank in opts.slow_ranks:
        for module in (model.attention.q, model.attention.k, model.attention.v,
                       model.attention.out, model.mlp.up, model.mlp.down, model.head):
            ExtraRows(module, rank, opts)
    parameters = list(model.parameters())
    # the fused optimizer steps the sharded parameters (DTensors) and the
    # replicated ones (the embeddings and norms) in a group each
    sharded = [p for p in parameters if isinstance(p, DTensor)]
    replicated = [p for p in parameters if not isinstance(p, DTensor)]
    optimizer = torch.optim.AdamW([{"params": sharded}, {"params": replicated}], lr=1e-3,
                                  weight_decay=0.1, fused=True)
    pairs = mesh.get_group("dp")
    data = batches(sequences(), rank, opts, BATCH, PAIRS, mesh.get_local_rank("dp"))

    def step(_: int) -> None:
        tokens, targets = next(data)
        optimizer.zero_grad()
        F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        for p in parameters:  # data parallel across the pairs: each rank its own shard
            assert p.grad is not None
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(grad, group=pairs)
            grad /= PAIRS
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
