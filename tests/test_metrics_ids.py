"""``metrics.group_ids``: dense ids per distinct key tuple, in the tuples'
sorted order, whichever of its paths (in order, small range, hashing) runs."""
from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from megatronapp.metrics import group_ids

COLUMN = st.lists(st.integers(-2**20, 2**20), min_size=1, max_size=300)


def _reference(*keys: np.ndarray) -> np.ndarray:
    _, ids = np.unique(np.stack(keys, axis=1), axis=0, return_inverse=True)
    return ids.reshape(-1)


@given(st.data(), st.integers(1, 3), st.sampled_from(["any", "sorted", "narrow"]))
def test_ids_are_the_sorted_distinct_tuples(data, width, shape):
    first = data.draw(COLUMN)
    keys = [np.array(first, np.int64)]
    for _ in range(width - 1):
        keys.append(np.array(data.draw(st.lists(st.integers(-2**20, 2**20), min_size=len(first),
                                                max_size=len(first))), np.int64))
    if shape == "sorted":  # rows already in key order: the scan path
        order = np.lexsort(keys[::-1])
        keys = [k[order] for k in keys]
    elif shape == "narrow":  # a small range of values: the presence-table path
        keys = [k % 7 for k in keys]
    ids, n = group_ids(*keys)
    expected = _reference(*keys)
    assert ids.tolist() == expected.tolist() and n == int(expected.max()) + 1


def test_wide_keys_that_overflow_one_integer_still_group():
    big = np.array([2**40, 0, 2**40, 5], np.int64)
    ids, n = group_ids(big, big, big)
    assert ids.tolist() == _reference(big, big, big).tolist() and n == 3
