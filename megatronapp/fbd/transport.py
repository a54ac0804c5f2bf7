"""Transports of the coordinator's alignment: the bitwise-OR all-reduce.

A coordinator's table is one bit vector (a Python int) per group. NCCL and
gloo have no bitwise OR, so the table travels in one of two encodings whose
ordinary reductions equal OR:

- ``bits``: one 0/1 element per (group, worker) bit; MAX of 0/1 values is OR.
- ``words``: bits packed into int64 words, 62 per word; SUM equals OR because
  every bit has exactly one owner (a worker is served by one coordinator), so
  no two processes ever add the same bit.

One extra trailing element carries "this process still has work" (MAX/SUM >
0 means someone does), so all control threads stop in the same round.
"""
from __future__ import annotations

from typing import Literal, Sequence

from .coordinator import GroupTable

Encoding = Literal["bits", "words"]
WORD_BITS = 62  # stays clear of the int64 sign bit even when summed


def encode_bits(table: Sequence[int], width: int) -> list[int]:
    return [(vector >> w) & 1 for vector in table for w in range(width)]


def decode_bits(flat: Sequence[int], groups: int, width: int) -> tuple[int, ...]:
    if len(flat) != groups * width:
        raise ValueError(f"expected {groups * width} bits, got {len(flat)}")
    return tuple(sum(1 << w for w in range(width) if flat[g * width + w])
                 for g in range(groups))


def encode_words(table: Sequence[int], width: int) -> list[int]:
    flat = 0
    for g, vector in enumerate(table):
        flat |= vector << (g * width)
    count = -(-len(table) * width // WORD_BITS)
    mask = (1 << WORD_BITS) - 1
    return [(flat >> (i * WORD_BITS)) & mask for i in range(count)]


def decode_words(words: Sequence[int], groups: int, width: int) -> tuple[int, ...]:
    flat = 0
    for i, word in enumerate(words):
        flat |= int(word) << (i * WORD_BITS)
    mask = (1 << width) - 1
    return tuple((flat >> (g * width)) & mask for g in range(groups))


def encode(table: Sequence[int], width: int, encoding: Encoding) -> list[int]:
    return encode_bits(table, width) if encoding == "bits" else encode_words(table, width)


def decode(flat: Sequence[int], groups: int, width: int, encoding: Encoding) -> tuple[int, ...]:
    if encoding == "bits":
        return decode_bits(flat, groups, width)
    return decode_words(flat, groups, width)


def table_bytes(table: GroupTable, encoding: Encoding = "words") -> int:
    """What one alignment all-reduce moves: the encoded table and the busy flag."""
    groups = (0,) * len(table)
    return 8 * (len(encode(groups, table.width, encoding)) + 1)
