"""Peers for point-to-point ops a trace recorded without them, only where
the trace leaves one choice.

A trace without peers says how many messages each rank sent and received,
and when; not to whom. A rank's sends are taken to go to one receiver only
if that rank pair fits (as many sends as the receiver has receives, and the
n-th receive ends after the n-th send starts) and no other assignment of
every sender to a receiver fits: the pairs must be forced, one by one (a
rank with one fitting partner left takes it). Anything else, a rank
sending to several peers included, leaves the ops unlinked: a guessed peer
could name a link the job never used.
"""
from __future__ import annotations

from typing import Iterable

Pair = tuple[int, int]  # (sender, receiver)


def forced_pairs(fitting: Iterable[Pair]) -> dict[int, int] | None:
    """sender -> receiver where every sender and every receiver of
    ``fitting`` gets exactly one partner and the choice is forced (then it
    is the only one); None where it is not."""
    left = set(fitting)
    senders = {r for r, _ in left}
    receivers = {s for _, s in left}
    if len(senders) != len(receivers):
        return None
    chosen: dict[int, int] = {}
    while left:
        pair = _forced(left)
        if pair is None:
            return None
        chosen[pair[0]] = pair[1]
        left = {(r, s) for r, s in left if r != pair[0] and s != pair[1]}
    return chosen if len(chosen) == len(senders) and set(chosen.values()) == receivers else None


def _forced(left: set[Pair]) -> Pair | None:
    """A pair whose sender or receiver has no other fitting partner."""
    for side in (0, 1):
        partners: dict[int, list[Pair]] = {}
        for pair in sorted(left):
            partners.setdefault(pair[side], []).append(pair)
        for pairs in partners.values():
            if len(pairs) == 1:
                return pairs[0]
    return None
