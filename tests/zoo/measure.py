"""What a zoo job's traces say about its ranks' own compute.

A rank's compute is the summed duration of its ``aten::mm`` / ``aten::addmm``
/ ``aten::bmm`` cpu_ops: every matmul of forward and backward (nothing else
in the zoo's jobs computes much), and none of the time spent waiting. A
profiled megatronapp run marks each of its compute ops with a range of its
own (``forward``, ``backward``), which also holds what a throttle adds:
there a rank's compute is the summed duration of those ranges."""
from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path
from typing import Any, Collection, Iterable

MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm"})
WORK_RANGES = frozenset({"forward", "backward"})


def traces(out: Path) -> Iterable[dict[str, Any]]:
    """Each rank's trace file in ``out`` (gzipped or not), read."""
    for path in sorted(out.glob("*.pt.trace.json*")):
        opened = gzip.open(path, "rt") if path.suffix == ".gz" else path.open()
        with opened as f:
            yield json.load(f)


def durations_of(out: Path, category: str, names: Collection[str]) -> dict[int, list[float]]:
    """Each rank's durations (µs) of its events named ``names`` in ``category``."""
    return {int(t["distributedInfo"]["rank"]): [
        e["dur"] for e in t["traceEvents"] if e.get("cat") == category and e.get("name") in names]
        for t in traces(out)}


def matmul_durations(out: Path) -> dict[int, list[float]]:
    """Each rank's matmul durations (µs), from its trace file in ``out``."""
    return durations_of(out, "cpu_op", MATMULS)


def work_range_seconds(out: Path) -> dict[int, float]:
    """Each rank's summed ``forward`` / ``backward`` ranges (s)."""
    return {rank: sum(d) / 1e6
            for rank, d in durations_of(out, "user_annotation", WORK_RANGES).items()}


def compute_seconds(out: Path) -> dict[int, float]:
    """Each rank's summed matmul time (s), from its trace file in ``out``."""
    return {rank: sum(d) / 1e6 for rank, d in matmul_durations(out).items()}


def fastest_matmul_us(out: Path) -> dict[int, float]:
    """Each rank's shortest matmul (µs): its speed when it had a core to
    itself. Sums are wall time: with four ranks on two cores, the peers'
    matmuls share the cores while the slowed rank often runs alone (they wait
    for it), which can hide even a 3x slowdown in the sums."""
    return {rank: min(d) for rank, d in matmul_durations(out).items()}


def realized_slowdown(seconds: dict[int, float], slow_rank: int | None,
                      alike: Collection[int] | None = None) -> float:
    """The slowed rank's compute over the median of its peers'; without a
    slowed rank, the largest such ratio over the ranks. ``alike``: the ranks
    that do the same work (all, if not given), the only ones compared."""
    seconds = {r: v for r, v in seconds.items() if alike is None or r in alike}

    def over_peers(rank: int) -> float:
        return seconds[rank] / statistics.median(v for r, v in seconds.items() if r != rank)
    if slow_rank is not None:
        return over_peers(slow_rank)
    return max(over_peers(rank) for rank in seconds)
