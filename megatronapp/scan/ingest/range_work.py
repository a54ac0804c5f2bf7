"""What a job's named range holds, so that ranges of one name on different
ranks are compared only when they are the same work.

A pipeline's stages annotate their work alike (``forward``, ``backward``,
``optimizer``) while the first stage's ``forward`` also embeds the tokens
and the last one's computes the output layer and the loss. Compared by name,
the last stage looks slow in every healthy run. A range's work is read
from the ops it holds: the top-level ops inside one occurrence, counted,
with each op's typical duration; a rank's mix is its most common
occurrence. Two ranks' ranges of one name are one op when the ops both run
(by name) carry ``SAME_WORK_SHARE`` of each one's time: a slowed rank's
bigger or repeated matmuls, and its few small extra ops (the rows it
concatenates to grow its matmuls), leave it comparable; a loss or an
embedding its peers never run does not.
Ranks whose range is other work get it under another name, with the op
that makes the difference (``forward (+_VocabParallelCrossEntropy)``).
"""
from __future__ import annotations

import statistics
from bisect import bisect_left
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

# the share of each rank's range (or, in the Kineto reader, whole compute)
# time that the ops it runs alike with another must carry to be the same work
SAME_WORK_SHARE = 0.9

Interval = tuple[float, float, str]  # start µs, end µs, op name


@dataclass(frozen=True)
class OpMix:
    """One rank's occurrence of a named range: each top-level op it holds,
    how many times, and that op's median duration (µs) on the rank."""

    counts: Mapping[str, int]
    typical_us: Mapping[str, float]

    def time_us(self) -> float:
        return sum(n * self.typical_us[op] for op, n in self.counts.items())

    def shared_share(self, other: OpMix) -> float:
        """The share of this mix's time in ops the other runs too."""
        total = self.time_us()
        if total <= 0:
            return 1.0
        return sum(n * self.typical_us[op] for op, n in self.counts.items()
                   if op in other.counts) / total

    def widest_difference(self, other: OpMix) -> str:
        """The op the other does not run that carries most of this mix's time."""
        return max((op for op in self.counts if op not in other.counts),
                   key=lambda op: self.counts[op] * self.typical_us[op])


def same_work(a: OpMix, b: OpMix) -> bool:
    return a.shared_share(b) >= SAME_WORK_SHARE and b.shared_share(a) >= SAME_WORK_SHARE


def top_level_inside(lo: float, hi: float, ops: Sequence[Interval],
                     starts: Sequence[float]) -> list[Interval]:
    """The ops of ``ops`` (sorted by start, longer first on ties; ``starts``
    their start times) inside [lo, hi] and not inside another such op."""
    out: list[Interval] = []
    open_end = -float("inf")
    for i in range(bisect_left(starts, lo), len(ops)):
        start, end, name = ops[i]
        if start > hi:
            break
        if end <= hi and start >= open_end:
            out.append(ops[i])
            open_end = end
    return out


def op_mixes(ranges: Iterable[tuple[str, Any, float, float]],
             ops_by_lane: Mapping[Any, Sequence[Interval]]) -> dict[str, OpMix]:
    """Per range name, the rank's mix: ``ranges`` are (name, lane, start,
    end) of the job's own annotations, ``ops_by_lane`` each thread's ops
    (communication aside), sorted by start."""
    starts = {lane: [o[0] for o in ops] for lane, ops in ops_by_lane.items()}
    occurrences: dict[str, Counter[frozenset[tuple[str, int]]]] = defaultdict(Counter)
    durations: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for name, lane, lo, hi in ranges:
        inside = top_level_inside(lo, hi, ops_by_lane.get(lane, ()), starts.get(lane, ()))
        occurrences[name][frozenset(Counter(op for _, _, op in inside).items())] += 1
        for start, end, op in inside:
            durations[name][op].append(end - start)
    mixes = {}
    for name, seen in occurrences.items():
        counts = dict(seen.most_common(1)[0][0])
        mixes[name] = OpMix(counts, {op: statistics.median(durations[name][op]) for op in counts})
    return mixes


def work_names(mixes: Mapping[int, Mapping[str, OpMix]]) -> dict[int, dict[str, str]]:
    """Per rank, the new name of each range that is other work than the
    same-named range of most ranks (ranks whose range is the same work as
    the most others' keep the name; the rest are grouped likewise)."""
    renamed: dict[int, dict[str, str]] = defaultdict(dict)
    names = {name for per_rank in mixes.values() for name in per_rank}
    for name in sorted(names):
        holders = {r: m[name] for r, m in mixes.items() if name in m}
        main, *others = _classes(holders)
        taken = {name}
        for members in others:
            new = f"{name} (+{holders[members[0]].widest_difference(holders[main[0]])})"
            new = new if new not in taken else f"{new} #{len(taken)}"
            taken.add(new)
            for r in members:
                renamed[r][name] = new
    return dict(renamed)


def _classes(holders: Mapping[int, OpMix]) -> list[list[int]]:
    """Ranks grouped by the same work, the class of the rank alike to the
    most others first; each rank joins the first class whose founder it is
    alike to."""
    alike = {r: sum(same_work(m, holders[o]) for o in holders if o != r)
             for r, m in holders.items()}
    classes: list[list[int]] = []
    for r in sorted(holders, key=lambda r: (-alike[r], r)):
        home = next((c for c in classes if same_work(holders[c[0]], holders[r])), None)
        if home is None:
            classes.append([r])
        else:
            home.append(r)
    return classes
