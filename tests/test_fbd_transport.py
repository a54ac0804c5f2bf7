"""Encodings of the OR all-reduce for transports without a bitwise OR."""
from __future__ import annotations

from hypothesis import given, strategies as st

from megatronapp.fbd.coordinator import or_tables
from megatronapp.fbd.transport import decode, encode


@st.composite
def owned_tables(draw):
    """Per process, a table whose set bits belong to that process's workers only."""
    width = draw(st.integers(1, 40))
    groups = draw(st.integers(1, 12))
    processes = draw(st.integers(1, 5))
    owner = [draw(st.integers(0, processes - 1)) for _ in range(width)]
    tables = []
    for p in range(processes):
        mine = sum(1 << w for w in range(width) if owner[w] == p)
        tables.append([draw(st.integers(0, (1 << width) - 1)) & mine for _ in range(groups)])
    return width, groups, tables


@given(owned_tables())
def test_max_of_bits_and_sum_of_words_both_equal_the_or(case):
    width, groups, tables = case
    expected = or_tables(tables)
    bits = [encode(t, width, "bits") for t in tables]
    words = [encode(t, width, "words") for t in tables]
    maxed = [max(col) for col in zip(*bits)]
    summed = [sum(col) for col in zip(*words)]
    assert decode(maxed, groups, width, "bits") == expected
    assert decode(summed, groups, width, "words") == expected
    assert all(0 <= w < 2 ** 63 for w in summed)  # fits int64 without overflow


@given(st.integers(1, 70), st.lists(st.integers(0, 2 ** 70), min_size=1, max_size=6))
def test_round_trip(width, table):
    table = [v & ((1 << width) - 1) for v in table]
    for encoding in ("bits", "words"):
        assert decode(encode(table, width, encoding), len(table), width, encoding) == tuple(table)
