"""``metrics.group_ids``: dense ids per distinct key tuple, in the tuples'
sorted order, whichever of its paths (in order, small range, sorting, hashing)
runs; ``metrics.nth_in_group``: each row's place in its group."""
from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from megatronapp.trace.metrics import distinct_ints, group_ids, nth_in_group, sums_at

COLUMN = st.lists(st.integers(-2**20, 2**20), min_size=1, max_size=300)


def _reference(*keys: np.ndarray) -> np.ndarray:
    _, ids = np.unique(np.stack(keys, axis=1), axis=0, return_inverse=True)
    return ids.reshape(-1)


@given(st.data(), st.integers(1, 3), st.sampled_from(["any", "sorted", "narrow", "few"]))
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
    elif shape == "few":  # a wide range but few distinct values: the hashing path
        keys = [(k % 3) << 30 for k in keys]
    ids, n = group_ids(*keys)
    expected = _reference(*keys)
    assert ids.tolist() == expected.tolist() and n == int(expected.max()) + 1


def test_wide_keys_that_overflow_one_integer_still_group():
    big = np.array([2**40, 0, 2**40, 5], np.int64)
    ids, n = group_ids(big, big, big)
    assert ids.tolist() == _reference(big, big, big).tolist() and n == 3


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(-5, 5), st.integers(-2**40, 2**40)),
                min_size=1, max_size=200))
def test_nth_in_group_counts_each_groups_rows_in_order_of_the_keys_then_rows(rows):
    ids, first, second = (np.array(c, np.int64) for c in zip(*rows))
    expected = []
    for i, row in enumerate(rows):
        before = [j for j, other in enumerate(rows) if other[0] == row[0]
                  and (other[1:], j) < (row[1:], i)]
        expected.append(len(before))
    assert nth_in_group(ids, [first, second]).tolist() == expected
    assert nth_in_group(ids).tolist() == [sum(1 for j in range(i) if rows[j][0] == rows[i][0])
                                          for i in range(len(rows))]


@given(st.lists(st.integers(-2**40, 2**40), max_size=300), st.sampled_from(["any", "narrow"]),
       st.sampled_from([np.int16, np.int32, np.int64]))
def test_distinct_ints_is_numpys_unique(values, shape, dtype):
    """Both the presence table (a narrow range) and the fallback give
    ``np.unique``'s distinct values, dtype and inverse."""
    array = np.array(values, np.int64)
    if shape == "narrow" or dtype != np.int64:
        array = array % 97 - 40
    array = array.astype(dtype)
    distinct, inverse = distinct_ints(array)
    expected, expected_inverse = np.unique(array, return_inverse=True)
    assert distinct.dtype == expected.dtype
    assert np.array_equal(distinct, expected)
    assert np.array_equal(inverse, expected_inverse.reshape(-1))


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4),
                          st.floats(-1e6, 1e6, allow_nan=False)), max_size=300))
def test_sums_at_adds_as_add_at_does(rows):
    """The same bits as ``np.add.at`` (floats added in the same order), and counts."""
    r = np.array([x[0] for x in rows], np.int64)
    c = np.array([x[1] for x in rows], np.int64)
    v = np.array([x[2] for x in rows], float)
    summed, counted = np.zeros((7, 5)), np.zeros((7, 5), np.int64)
    np.add.at(summed, (r, c), v)
    np.add.at(counted, (r, c), 1)
    assert np.array_equal(sums_at((7, 5), r, c, v), summed)
    assert np.array_equal(sums_at((7, 5), r, c), counted)
