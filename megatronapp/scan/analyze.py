"""Per-rank compute / communication / idle time, bubble fraction, iteration
times, and the critical path through the ranks.

Works on our traces (each event's recorded kind) and on foreign ones (kinds
from names, ``megatronapp.trace.kinds``). Times are unions of intervals over the
trace's window (first start to last end over all ranks): communication is what
compute does not hide, idle is everything else. A rank with GPU work (a
torch.profiler trace of a GPU job) is measured by its streams instead
(``gpu_time``): its window is its GPU's, its communication what its kernels
spent in NCCL and memory operations that compute did not hide, and its
bubble fraction its GPU's idle share.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from megatronapp.trace.kinds import event_kind, is_comm
from megatronapp.io.progress import Say, quiet
from megatronapp.trace.summary import bubble_fraction, iteration_times, union_length

from megatronapp.scan.evidence.critical import critical_path
from megatronapp.scan.ingest.deps import SyncOp, reconstruct
from megatronapp.scan.ingest.gpu_time import gpu_times, mean_idle_fraction
from megatronapp.scan.ingest.load import RankEvents


@dataclass(frozen=True)
class RankTime:
    compute_s: float
    comm_s: float
    idle_s: float


def rank_times(events: RankEvents) -> dict[int, RankTime]:
    starts = [e.start_s for ev in events.values() for e in ev]
    window = (max(e.end_s for ev in events.values() for e in ev) - min(starts)) if starts else 0.0
    gpu = gpu_times(events)
    out = {r: RankTime(t.compute_s, t.exposed_s, t.idle_s) for r, t in gpu.items()}
    for rank, evs in events.items():
        if rank in gpu:
            continue
        kinds = [event_kind(e.name, e.args) for e in evs]
        compute = [(e.start_s, e.end_s) for e, k in zip(evs, kinds) if k == "compute"]
        comm = [(e.start_s, e.end_s) for e, k in zip(evs, kinds) if is_comm(k)]
        busy = union_length(compute)
        both = union_length(compute + comm)
        out[rank] = RankTime(busy, both - busy, max(window - both, 0.0))
    return out


def _has_iterations(events: RankEvents) -> bool:
    return any("iteration" in e.args for ev in events.values() for e in ev[:50])


def analyze(events: RankEvents, ops: Sequence[SyncOp] | None = None,
            say: Say = quiet) -> dict[str, Any]:
    """The JSON of ``megatronapp analyze`` (``ops``: the trace's linked sync ops)."""
    say("splitting each rank's time")
    times = rank_times(events)
    gpu_idle = mean_idle_fraction(events)
    if gpu_idle is not None:
        bubble, iters = gpu_idle, iteration_times(events)
    elif _has_iterations(events):
        bubble, iters = bubble_fraction(events), iteration_times(events)
    else:  # no iteration marks: the whole window is one step
        window = [t.compute_s + t.comm_s + t.idle_s for t in times.values()]
        bubble = (sum(1 - t.compute_s / w for t, w in zip(times.values(), window) if w > 0)
                  / len(times)) if times else 0.0
        iters = [max(window)] if window else []
    say(f"finding the critical path through {sum(map(len, events.values()))} events")
    path = critical_path(events, reconstruct(events) if ops is None else ops)
    gpu = gpu_times(events)
    return {"ranks": {str(r): {"compute_s": t.compute_s, "comm_s": t.comm_s, "idle_s": t.idle_s,
                               **({"gpu": gpu[r].to_json()} if r in gpu else {})}
                      for r, t in sorted(times.items())},
            "bubble_fraction": bubble, "iteration_times_s": iters,
            "critical_path": path.to_json()}


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
    return "\n".join(lines + list(format_critical_path(result["critical_path"])))


def _shares(totals: dict[str, float], window: float, limit: int, label: str = "") -> str:
    items = list(totals.items())
    shown = ", ".join(f"{label}{key} {100 * t / window:.1f}%" for key, t in items[:limit])
    return shown + (f", ... {len(items) - limit} more" if len(items) > limit else "")


WHERE = {"iteration": "it", "microbatch": "mb", "chunk": "ch"}


def format_critical_path(path: dict[str, Any], max_ops: int = 12) -> Iterator[str]:
    """Where the critical path spends the trace's window, and its first ops."""
    window, ops = path["window_s"], path["ops"]
    if window <= 0:
        return
    yield (f"critical path: {path['length_s'] * 1e3:.3f} ms of the {window * 1e3:.3f} ms window "
           f"({100 * path['length_s'] / window:.1f}%), {len(ops)} ops")
    yield "  by kind: " + _shares(path["by_kind"], window, 4)
    yield "  by rank: " + _shares(path["by_rank"], window, 8, "rank ")
    for op in ops[:max_ops]:
        where = " ".join(f"{short}{op[key]}" for key, short in WHERE.items() if key in op)
        yield (f"  at {(op['start_s'] - path['window_start_s']) * 1e3:9.3f} ms  rank "
               f"{op['rank']:<5} {op['name']:<20} {op['seconds'] * 1e3:9.3f} ms  {where}")
    if len(ops) > max_ops:
        yield f"  ... {len(ops) - max_ops} more ops (--json for all)"
