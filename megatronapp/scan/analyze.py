"""Per-rank compute / communication / idle time, bubble fraction, iteration times.

Works on our traces and on foreign ones: ops named forward/backward/optimizer
or like a GPU kernel count as compute, send/recv/collective names as
communication. Times are unions of intervals over the trace's window (first
start to last end over all ranks), so the three parts add up to the window:
communication is what compute does not hide, idle is everything else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatronapp.summary import bubble_fraction, iteration_times, union_length

from .kinds import kind_of
from .load import RankEvents

@dataclass(frozen=True)
class RankTime:
    compute_s: float
    comm_s: float
    idle_s: float


def rank_times(events: RankEvents) -> dict[int, RankTime]:
    starts = [e.start_s for ev in events.values() for e in ev]
    window = (max(e.end_s for ev in events.values() for e in ev) - min(starts)) if starts else 0.0
    out = {}
    for rank, evs in events.items():
        compute = [(e.start_s, e.end_s) for e in evs if kind_of(e.name, e.args) == "compute"]
        comm = [(e.start_s, e.end_s) for e in evs if kind_of(e.name, e.args) == "comm"]
        busy = union_length(compute)
        both = union_length(compute + comm)
        out[rank] = RankTime(busy, both - busy, max(window - both, 0.0))
    return out


def _has_iterations(events: RankEvents) -> bool:
    return any("iteration" in e.args for ev in events.values() for e in ev[:50])


def analyze(events: RankEvents) -> dict[str, Any]:
    """The JSON of ``megatronapp analyze``."""
    times = rank_times(events)
    if _has_iterations(events):
        bubble, iters = bubble_fraction(events), iteration_times(events)
    else:  # no iteration marks: the whole window is one step
        window = [t.compute_s + t.comm_s + t.idle_s for t in times.values()]
        bubble = (sum(1 - t.compute_s / w for t, w in zip(times.values(), window) if w > 0)
                  / len(times)) if times else 0.0
        iters = [max(window)] if window else []
    return {"ranks": {str(r): {"compute_s": t.compute_s, "comm_s": t.comm_s, "idle_s": t.idle_s}
                      for r, t in sorted(times.items())},
            "bubble_fraction": bubble, "iteration_times_s": iters}


def format_analysis(result: dict[str, Any], max_ranks: int = 32) -> str:
    lines = [f"{'rank':>6} {'compute ms':>11} {'comm ms':>9} {'idle ms':>9}"]
    ranks = list(result["ranks"].items())
    for rank, t in ranks[:max_ranks]:
        lines.append(f"{rank:>6} {t['compute_s'] * 1e3:11.3f} {t['comm_s'] * 1e3:9.3f} "
                     f"{t['idle_s'] * 1e3:9.3f}")
    if len(ranks) > max_ranks:
        lines.append(f"   ... {len(ranks) - max_ranks} more ranks (--json for all)")
    iters = ", ".join(f"{t * 1e3:.3f}" for t in result["iteration_times_s"])
    lines.append(f"bubble fraction: {result['bubble_fraction']:.3f}")
    lines.append(f"iteration times (ms): {iters or '-'}")
    return "\n".join(lines)
