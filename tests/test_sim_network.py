"""Shortcuts of the random streams and ring costs take the very values, in the
very stream order, that drawing one value at a time would."""
from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from sim.draws import BLOCK, NormalStream
from sim.network import Ring

SEEDS = st.integers(0, 2**32 - 1)


def _stream(seed: int) -> NormalStream:
    return NormalStream(np.random.default_rng(seed))


@given(seed=SEEDS, skip=st.integers(0, 3 * BLOCK), n=st.integers(1, 3 * BLOCK))
def test_max_of_is_the_largest_of_the_next_n_draws_and_consumes_exactly_them(
        seed: int, skip: int, n: int) -> None:
    fast, slow = _stream(seed), _stream(seed)
    for _ in range(skip):
        fast.draw()
        slow.draw()
    assert fast.max_of(n) == max(slow.draw() for _ in range(n))
    assert fast.draw() == slow.draw(), "both streams go on from the same place"


@given(seed=SEEDS, n=st.integers(2, 70), factor=st.sampled_from([1.0, 2.5]),
       sigma=st.floats(0.01, 1.0), fixed_s=st.sampled_from([None, 0.5]),
       uses=st.lists(st.tuples(st.integers(0, 10**9), st.sampled_from([1, 2])), min_size=1,
                     max_size=20))
def test_a_ring_jittered_alike_everywhere_costs_what_its_worst_edge_drawn_one_by_one_costs(
        seed: int, n: int, factor: float, sigma: float, fixed_s: float | None,
        uses: list[tuple[int, int]]) -> None:
    edges = [(factor, sigma)] * n
    fast = Ring(n, 1e10, edges, _stream(seed), 2e-6, fixed_s)
    edge_by_edge = Ring(n, 1e10, edges, _stream(seed), 2e-6, fixed_s)
    assert fast.alike is not None
    edge_by_edge.alike = None
    for nbytes, steps in uses:
        assert fast.seconds(nbytes, steps) == edge_by_edge.seconds(nbytes, steps)


def test_a_ring_with_one_edge_unlike_the_others_prices_edge_by_edge() -> None:
    alike = [(1.0, 0.1)] * 4
    assert Ring(4, 1e10, alike, _stream(0), 0.0, None).alike is not None
    assert Ring(4, 1e10, alike[:3] + [(2.0, 0.1)], _stream(0), 0.0, None).alike is None
    assert Ring(4, 1e10, alike[:3] + [(1.0, 0.0)], _stream(0), 0.0, None).alike is None
