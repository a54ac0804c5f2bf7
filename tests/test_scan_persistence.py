"""A persistent fault is one that counts in more of the iterations it was
seen in than a healthy suspect would by chance (``detect.persistent``): in
every one of a short trace, in most of a long one."""
from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatronapp.scan.evidence.detect import (SIGNIFICANCE, Evidence, binomial_tail, judge,
                                              persistent)
from megatronapp.scan.evidence.params import Params

chances = st.floats(min_value=0.01, max_value=0.99)


@given(st.integers(1, 10), st.data(), chances)
@settings(max_examples=200, deadline=None)
def test_the_tail_is_the_share_of_every_outcome_with_at_least_k_hits(n: int, data, chance: float):
    k = data.draw(st.integers(0, n))
    enumerated = sum(chance ** sum(o) * (1 - chance) ** (n - sum(o))
                     for o in itertools.product((0, 1), repeat=n) if sum(o) >= k)
    assert binomial_tail(k, n, chance) == pytest.approx(enumerated, rel=1e-9, abs=1e-12)


@given(st.integers(1, 40), st.data(), chances)
@settings(max_examples=200, deadline=None)
def test_one_more_iteration_counted_never_makes_a_suspect_less_persistent(n: int, data,
                                                                          chance: float):
    k = data.draw(st.integers(0, n - 1))
    p = replace(Params(), chance_count=chance)
    fewer = np.arange(n) < k
    more = np.arange(n) <= k
    assert persistent(more, p) or not persistent(fewer, p)


@given(st.integers(1, 40), chances)
def test_every_iteration_counted_is_persistent_and_none_is_not(n: int, chance: float):
    p = replace(Params(), chance_count=chance)
    assert persistent(np.ones(n, bool), p)
    assert not persistent(np.zeros(n, bool), p)


def test_a_longer_trace_lets_a_fault_miss_a_few_iterations_a_short_one_does_not():
    """The same share of iterations, three in four: in four iterations a healthy
    suspect counts in three often enough to be chance, in twenty-four it
    seldom counts in eighteen."""
    p = Params()
    short, long_ = np.array([1, 1, 1, 0], bool), np.tile([1, 1, 1, 0], 6).astype(bool)
    assert binomial_tail(3, 4, p.chance_count) > SIGNIFICANCE
    assert not persistent(short, p)
    assert persistent(long_, p)


def _slow_in(iterations: np.ndarray) -> Evidence:
    """A rank's compute 60% over its expected 50 ms (6 noise units) in the
    iterations marked, at its expected time in the others, in 100 ms iterations."""
    n = len(iterations)
    actual = np.where(iterations, 0.08, 0.05)
    blame = actual - 0.05
    duration = np.full(n, 0.1)
    return Evidence("compute", 2, "peers", np.arange(n), actual, np.full(n, 0.05), blame,
                    np.full(n, 0.005), duration, np.cumsum(blame), np.cumsum(duration))


def test_a_rank_slow_in_most_of_twelve_iterations_is_named_with_them_and_in_half_is_not():
    most = np.array([1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1], bool)  # ten of twelve
    (cause,) = judge([_slow_in(most)], Params())
    assert cause.rank == 2 and cause.evidence["iterations_hit"] == np.flatnonzero(most).tolist()
    assert judge([_slow_in(np.tile([1, 0], 6).astype(bool))], Params()) == []
