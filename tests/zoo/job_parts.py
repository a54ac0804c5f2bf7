"""What the held-out jobs share: a slowed rank's extra rows on a tensor-parallel
linear layer's local input (``ExtraRows``), token sequences of a random
Markov chain to train a language model on (``markov_sequences``),
clustered feature vectors to classify (``clustered_samples``), a
pre-norm residual feed-forward block (``FeedForwardBlock``), and the
gradients of a list of parameters as one flat buffer and back
(``flat_gradients``, ``unflatten_gradients``).

Imported by the jobs the way they import ``launch`` (``tests/zoo`` on the path)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

from launch import Options, Rows, grow


def gradient_layout(placements: Sequence[Placement]) -> list[Placement]:
    """Where a parallel linear layer's gradients come back to it: a
    replicated input's gradient is partial (a sum over the ranks' shares),
    a partial output's gradient replicated, a shard's a shard."""
    return [Partial() if p.is_replicate() else Replicate() if p.is_partial() else p
            for p in placements]


def on_local_rows(x: DTensor, rows: Callable[[torch.Tensor], torch.Tensor]) -> DTensor:
    """``x`` with ``rows`` applied to this rank's local tensor, its gradient
    passed back as it comes (no collective on one rank alone)."""
    grads = gradient_layout(x.placements)
    local = rows(x.to_local(grad_placements=grads))
    return DTensor.from_local(local, x.device_mesh, x.placements, grad_placements=grads)


class ExtraRows:
    """Hooks on a parallel linear layer of the slowed rank: it computes on
    extra rows of its local input (after the plan has laid the input out)
    and drops them from its local output (before the plan's collectives)."""

    def __init__(self, module: nn.Module, rank: int, opts: Options) -> None:
        self.rank, self.opts, self.rows = rank, opts, 0
        module.register_forward_pre_hook(self.grown)
        module.register_forward_hook(self.trimmed, prepend=True)

    def grown(self, _: nn.Module, inputs: tuple[DTensor, ...]) -> tuple[DTensor, ...] | None:
        rows = len(inputs[0].to_local())
        if round(rows * (self.opts.scale(self.rank) - 1.0)) <= 0:
            return None
        self.rows = rows
        return (on_local_rows(inputs[0], lambda x: grow(x, self.rank, self.opts)), *inputs[1:])

    def trimmed(self, _: nn.Module, _inputs: Any, y: DTensor) -> DTensor | None:
        if not self.rows:
            return None
        rows, self.rows = self.rows, 0
        return on_local_rows(y, lambda x: x[:rows])


def markov_sequences(vocab: int, count: int, context: int) -> Rows:
    """``count`` token sequences of ``context`` tokens from a random first-order
    Markov chain (each token followed by one of a few likely successors),
    and the next tokens."""
    g = torch.Generator().manual_seed(0)
    successors = torch.randint(0, vocab, (vocab, 4), generator=g)
    tokens = torch.empty(count, context + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (count,), generator=g)
    for t in range(context):
        tokens[:, t + 1] = successors[tokens[:, t], torch.randint(0, 4, (count,), generator=g)]
    return Rows(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def clustered_samples(classes: int, count: int, features: int) -> Rows:
    """``count`` feature vectors around one of four centres per class, and their classes."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(classes, 4, features, generator=g)
    labels = torch.randint(0, classes, (count,), generator=g)
    which = torch.randint(0, 4, (count,), generator=g)
    return Rows(centres[labels, which] + 0.5 * torch.randn(count, features, generator=g), labels)


class FeedForwardBlock(nn.Module):
    """A pre-norm residual feed-forward block: LayerNorm, a linear layer
    ``expansion`` times wider, ``activation``, a linear layer back, the residual."""

    def __init__(self, width: int, expansion: int,
                 activation: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.activation = activation
        self.norm = nn.LayerNorm(width)
        hidden = expansion * width
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.activation(self.up(self.norm(x))))


def flat_gradients(parameters: Sequence[nn.Parameter]) -> torch.Tensor:
    """The gradients of ``parameters`` joined into one flat buffer, in order
    (one message for a collective or a hand-written exchange)."""
    grads = [p.grad for p in parameters]
    assert all(g is not None for g in grads)
    return torch.cat([g.flatten() for g in grads if g is not None])


def unflatten_gradients(flat: torch.Tensor, parameters: Sequence[nn.Parameter]) -> None:
    """Copy each parameter's part of ``flat`` back into its gradient."""
    for p, part in zip(parameters, flat.split([p.numel() for p in parameters])):
        assert p.grad is not None
        p.grad.copy_(part.view_as(p.grad))
