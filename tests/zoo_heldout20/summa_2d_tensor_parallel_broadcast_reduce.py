"""Two-dimensional tensor parallelism by SUMMA (van de Geijn and Watts,
"SUMMA: Scalable Universal Matrix Multiplication Algorithm", 1997), as
Optimus lays a network's layers out on a square grid of devices (Xu, Li,
Gong and You, "An Efficient 2D Method for Training Super-Large Deep
Learning Models", 2021; Colossal-AI's 2D tensor parallelism): the four
ranks form a 2 x 2 grid (rank = 2 x row + column), with a process group per
row and one per column (``dist.new_group``). Every activation is cut in
2 x 2 blocks (its rows, the samples, by grid row; its features by grid
column) and so is every weight (its input features by grid row, its output
features by grid column); rank (i, j) holds block (i, j) of each. A layer's
output block C_ij = sum_l A_il W_lj takes two steps: in step l, rank
(i, l) broadcasts its activation block along row i and rank (l, j) its
weight block down column j (``dist.broadcast`` in the row's and the
column's group), and every rank multiplies what it received (``torch.mm``)
and adds it up. The broadcast is a ``torch.autograd.Function`` whose
backward is a reduce, as Optimus derives the backward of a broadcast: the
gradients of a block every member received are summed into the member
that sent it (``dist.reduce`` in the same group), so that dA_il = sum_j
dC_ij W_lj^T collects along row i and dW_lj = sum_i A_il^T dC_ij down
column j. A bias block is kept by both ranks of its column, its gradient
all-reduced in the column's group. The network: a denoising MLP (256 ->
512 -> 512 -> 256, GELU between the layers) that restores feature vectors
around one of four centres per class from noisy copies, the mean-square
error summed over each rank's output block (the blocks' errors add up to
the whole batch's); every rank steps Adam on its own blocks. Each grid row
reads its share of the data (a DataLoader with a DistributedSampler over
the two rows; both ranks of a row read the same batches) and each rank
keeps its column's half of the features.

    PYTHONPATH=tests/zoo python tests/zoo_heldout20/summa_2d_tensor_parallel_broadcast_reduce.py --out DIR
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch import Options, Rows, Step, batches, grow, main
from job_parts import clustered_samples

GRID = 2  # a GRID x GRID grid of ranks
WIDTHS = (256, 512, 512, 256)
CLASSES, SAMPLES, BATCH, NOISE = 10, 16384, 512, 0.5
ROWS = BATCH // GRID  # the samples of one grid row's batch


class Broadcast(torch.autograd.Function):
    """A block from one member of a group to every member; in the backward the
    members' gradients for it are summed into that member (``dist.reduce``).
    Every member passes a block of the same shape (its own), so that every
    member's backward runs the reduce; only the source's gets a gradient."""

    @staticmethod
    def forward(ctx: Any, block: torch.Tensor, src: int,
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.src, ctx.group, ctx.mine = src, group, dist.get_rank() == src
        received = block.detach().clone() if ctx.mine else torch.empty_like(block)
        dist.broadcast(received, src=src, group=group)
        return received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        total = grad.contiguous().clone()
        dist.reduce(total, dst=ctx.src, group=ctx.group)
        return (total if ctx.mine else None), None, None


class Grid:
    """This rank's place on the grid and the groups of its row and column."""

    def __init__(self, rank: int, opts: Options) -> None:
        self.rank, self.opts = rank, opts
        self.row, self.column = divmod(rank, GRID)
        # every rank creates every group, in the same order
        rows = [dist.new_group([GRID * i + j for j in range(GRID)]) for i in range(GRID)]
        columns = [dist.new_group([GRID * i + j for i in range(GRID)]) for j in range(GRID)]
        self.row_group, self.column_group = rows[self.row], columns[self.column]

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b``; the slowed rank also multiplies extra rows of ``a``, in a
        call of their own (a product of another size may be computed in
        another order), whose products are dropped (their backward runs, on
        zeros)."""
        grown = grow(a, self.rank, self.opts)
        c = torch.mm(a, b)
        if len(grown) > len(a):
            c = torch.cat([c, torch.mm(grown[len(a):], b)])[:len(a)]
        return c

    def summa(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """This rank's block of A W from its blocks of A and W: C_ij = sum_l
        A_il W_lj, A_il broadcast along row i from (i, l), W_lj down column j
        from (l, j)."""
        c = None
        for l in range(GRID):
            a_l = Broadcast.apply(a, GRID * self.row + l, self.row_group)
            w_l = Broadcast.apply(w, GRID * l + self.column, self.column_group)
            product = self.mm(a_l, w_l)
            c = product if c is None else c + product
        assert c is not None
        return c


class Linear2D(nn.Module):
    """A linear layer whose weight and bias are this rank's blocks of the whole
    layer's (drawn alike on every rank, then cut)."""

    def __init__(self, grid: Grid, features_in: int, features_out: int) -> None:
        super().__init__()
        self.grid = grid
        whole = nn.Linear(features_in, features_out)  # the global RNG, seeded alike
        rows_in, columns_out = features_in // GRID, features_out // GRID
        weight = whole.weight.detach().t()  # input features by output features
        self.weight = nn.Parameter(weight[grid.row * rows_in:(grid.row + 1) * rows_in,
                                          grid.column * columns_out:
                                          (grid.column + 1) * columns_out].clone())
        self.bias = nn.Parameter(whole.bias.detach()[grid.column * columns_out:
                                                     (grid.column + 1) * columns_out].clone())

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return self.grid.summa(a, self.weight) + self.bias


def denoising() -> Rows:
    clean, _ = clustered_samples(CLASSES, SAMPLES, WIDTHS[0]).tensors
    noise = torch.randn(clean.shape, generator=torch.Generator().manual_seed(1))
    return Rows(clean + NOISE * noise, clean)


def build(rank: int, opts: Options) -> Step:
    assert dist.get_world_size() == GRID * GRID
    grid = Grid(rank, opts)
    torch.manual_seed(0)  # every rank draws the same whole layers
    layers = nn.ModuleList(Linear2D(grid, a, b) for a, b in zip(WIDTHS, WIDTHS[1:]))
    optimizer = torch.optim.Adam(layers.parameters(), lr=1e-3)
    data = batches(denoising(), rank, opts, ROWS, replicas=GRID, replica=grid.row)
    half_in, half_out = WIDTHS[0] // GRID, WIDTHS[-1] // GRID
    elements = BATCH * WIDTHS[-1]

    def step(_: int) -> None:
        noisy, clean = next(data)
        x = noisy[:, grid.column * half_in:(grid.column + 1) * half_in]
        target = clean[:, grid.column * half_out:(grid.column + 1) * half_out]
        for k, layer in enumerate(layers):
            x = layer(x)
            if k < len(layers) - 1:
                x = F.gelu(x)
        loss = (x - target).square().sum() / elements
        loss.backward()
        for layer in layers:
            assert layer.bias.grad is not None
            dist.all_reduce(layer.bias.grad, group=grid.column_group)
        optimizer.step()
        optimizer.zero_grad()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
