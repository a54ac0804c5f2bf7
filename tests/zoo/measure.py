"""What a zoo job's traces say about its ranks' own compute.

A rank's compute is the summed duration of its ``aten::mm`` / ``aten::addmm``
/ ``aten::bmm`` cpu_ops: every matmul of forward and backward (nothing else
in the zoo's jobs computes much), and none of the time spent waiting."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm"})


def matmul_durations(out: Path) -> dict[int, list[float]]:
    """Each rank's matmul durations (µs), from its trace file in ``out``."""
    durations = {}
    for path in out.glob("*.pt.trace.json"):
        trace = json.loads(path.read_text())
        durations[int(trace["distributedInfo"]["rank"])] = [
            e["dur"] for e in trace["traceEvents"]
            if e.get("cat") == "cpu_op" and e.get("name") in MATMULS]
    return durations


def compute_seconds(out: Path) -> dict[int, float]:
    """Each rank's summed matmul time (s), from its trace file in ``out``."""
    return {rank: sum(d) / 1e6 for rank, d in matmul_durations(out).items()}


def fastest_matmul_us(out: Path) -> dict[int, float]:
    """Each rank's shortest matmul (µs): its speed when it had a core to
    itself. Sums are wall time: with four ranks on two cores, the peers'
    matmuls share the cores while the slowed rank often runs alone (they wait
    for it), which can hide even a 3x slowdown in the sums."""
    return {rank: min(d) for rank, d in matmul_durations(out).items()}


def realized_slowdown(seconds: dict[int, float], slow_rank: int | None) -> float:
    """The slowed rank's compute over the median of its peers'; without a
    slowed rank, the largest such ratio over the ranks."""
    def over_peers(rank: int) -> float:
        return seconds[rank] / statistics.median(v for r, v in seconds.items() if r != rank)
    if slow_rank is not None:
        return over_peers(slow_rank)
    return max(over_peers(rank) for rank in seconds)
