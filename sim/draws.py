"""Random streams drawn in blocks, and the exponential they are used through.

``Generator.normal(0, σ)`` one value at a time costs about 2 µs in numpy;
drawing a block of standard normals gives the very same sequence (σ·z is
bitwise ``normal(0, σ)``, and consecutive blocks concatenate to one long
draw), so every stream hands out values from a block, one at a time
(``draw``) or many at once (``take``).

A jitter multiplier is ``exp(σ·z)`` as ``math.exp`` computes it (the C
library's). numpy's own vectorised ``exp`` differs from it in the last bit
for a few percent of arguments, so ``exact_exp`` calls the C library's in a
compiled loop: the scalar and the bulk paths give the same numbers.
"""
from __future__ import annotations

import numba
import numpy as np

BLOCK = 64


@numba.njit(cache=True)
def _exp_loop(x: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover (compiled)
    for i in range(x.size):
        out[i] = np.exp(x[i])


def exact_exp(x: np.ndarray) -> np.ndarray:
    """``math.exp`` of every element (bitwise), in bulk."""
    x = np.ascontiguousarray(x, np.float64)
    out = np.empty_like(x)
    _exp_loop(x.ravel(), out.ravel())
    return out


class NormalStream:
    """Standard normal values of one generator, in the generator's order."""

    __slots__ = ("_rng", "_block", "_next")

    def __init__(self, rng: np.random.Generator):
        self._rng = rng
        self._block: list[float] = []
        self._next = 0

    def draw(self) -> float:
        if self._next == len(self._block):
            self._block = self._rng.standard_normal(BLOCK).tolist()
            self._next = 0
        z = self._block[self._next]
        self._next += 1
        return z

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` values as an array (what ``n`` calls of ``draw`` give)."""
        held = self._block[self._next:]
        if n <= len(held):
            self._next += n
            return np.array(held[:n], np.float64)
        fresh = self._rng.standard_normal(n - len(held))
        self._block, self._next = [], 0
        return np.concatenate((np.array(held, np.float64), fresh))

    def max_of(self, n: int) -> float:
        """The largest of the next ``n`` values (all ``n`` are consumed)."""
        i, block = self._next, self._block
        if i + n <= len(block):
            self._next = i + n
            return max(block[i:i + n])
        return max(self.draw() for _ in range(n))
