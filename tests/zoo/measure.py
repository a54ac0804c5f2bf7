"""What a zoo job's traces say about its ranks' own compute.

A rank's compute is the summed duration of its ``aten::mm`` / ``aten::addmm``
/ ``aten::bmm`` cpu_ops: every matmul of forward and backward (nothing else
in the zoo's jobs computes much), and none of the time spent waiting."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm"})


def compute_seconds(out: Path) -> dict[int, float]:
    """Each rank's summed matmul time (s), from its trace file in ``out``."""
    seconds = {}
    for path in out.glob("*.pt.trace.json"):
        trace = json.loads(path.read_text())
        rank = int(trace["distributedInfo"]["rank"])
        seconds[rank] = sum(e["dur"] for e in trace["traceEvents"]
                            if e.get("cat") == "cpu_op" and e.get("name") in MATMULS) / 1e6
    return seconds


def realized_slowdown(seconds: dict[int, float], slow_rank: int | None) -> float:
    """The slowed rank's compute over the median of its peers'; without a
    slowed rank, the largest such ratio over the ranks."""
    def over_peers(rank: int) -> float:
        return seconds[rank] / statistics.median(v for r, v in seconds.items() if r != rank)
    if slow_rank is not None:
        return over_peers(slow_rank)
    return max(over_peers(rank) for rank in seconds)
