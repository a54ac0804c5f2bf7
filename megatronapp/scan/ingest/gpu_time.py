"""GPU time as the GPU spent it: per rank, what its streams were busy with.

A GPU runs kernels on several CUDA streams at once, so a rank's busy time is
the union of its work's intervals over every stream, never their sum. Its
window runs from its first GPU activity to its last; per iteration (the
profiler step its launches fell in) from that iteration's first activity to
the next one's first. Within a window:

- compute: the union of its kernels other than NCCL's;
- communication: the union of its NCCL kernels; ``overlap`` the part of it
  that compute hides;
- memory: the union of its memory copies and sets;
- busy: the union of all three; idle: the window less busy, so an idle
  fraction is in [0, 1] whatever the streams do.

These are the figures of HolisticTraceAnalysis' temporal breakdown (its
``kernel_time``, ``compute_time``, ``idle_time``) on the same files. What
the reader marks as GPU work is an event with a ``stream`` arg
(``kineto._rank_events``); its kind says compute, communication or (other)
memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from megatronapp.trace.events import Event
from megatronapp.trace.kinds import event_kind, is_comm

Intervals = tuple[np.ndarray, np.ndarray]  # merged: sorted starts, their ends


@dataclass(frozen=True)
class GpuTime:
    """One rank's GPU time in a window (seconds)."""

    window_s: float
    busy_s: float
    compute_s: float
    comm_s: float
    memory_s: float
    overlap_s: float  # communication under compute

    @property
    def idle_s(self) -> float:
        return self.window_s - self.busy_s

    @property
    def exposed_s(self) -> float:
        """Busy without compute: communication and memory work nothing hides."""
        return self.busy_s - self.compute_s

    @property
    def idle_fraction(self) -> float:
        return self.idle_s / self.window_s if self.window_s > 0 else 0.0

    def to_json(self) -> dict[str, float]:
        return {"window_s": self.window_s, "busy_s": self.busy_s, "compute_s": self.compute_s,
                "comm_s": self.comm_s, "memory_s": self.memory_s, "overlap_s": self.overlap_s,
                "idle_s": self.idle_s}


def is_gpu_work(e: Event) -> bool:
    return "stream" in e.args


def merged(starts: np.ndarray, ends: np.ndarray) -> Intervals:
    """The union of intervals, as disjoint sorted intervals."""
    if not len(starts):
        return np.zeros(0), np.zeros(0)
    order = np.argsort(starts, kind="stable")
    lo, hi = starts[order], np.maximum.accumulate(ends[order])
    new = np.r_[True, lo[1:] > hi[:-1]]
    first = np.flatnonzero(new)
    last = np.r_[first[1:] - 1, len(lo) - 1]
    return lo[first], hi[last]


def length(iv: Intervals) -> float:
    return float((iv[1] - iv[0]).sum())


def clipped(iv: Intervals, lo: float, hi: float) -> Intervals:
    starts, ends = np.maximum(iv[0], lo), np.minimum(iv[1], hi)
    keep = ends > starts
    return starts[keep], ends[keep]


def union_of(*parts: Intervals) -> Intervals:
    return merged(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))


def _kinds(events: Sequence[Event]) -> dict[str, Intervals]:
    """The rank's GPU work, merged by what it is."""
    spans: dict[str, list[tuple[float, float]]] = {"compute": [], "comm": [], "memory": []}
    for e in events:
        if not is_gpu_work(e):
            continue
        kind = event_kind(e.name, e.args)
        what = "compute" if kind == "compute" else "comm" if is_comm(kind) else "memory"
        spans[what].append((e.start_s, e.end_s))
    return {k: merged(np.array([a for a, _ in v], float), np.array([b for _, b in v], float))
            for k, v in spans.items()}


def _time(kinds: Mapping[str, Intervals], lo: float, hi: float) -> GpuTime:
    part = {k: clipped(iv, lo, hi) for k, iv in kinds.items()}
    compute, comm, memory = (length(part[k]) for k in ("compute", "comm", "memory"))
    overlap = compute + comm - length(union_of(part["compute"], part["comm"]))
    return GpuTime(hi - lo, length(union_of(*part.values())), compute, comm, memory, overlap)


def rank_gpu_time(events: Sequence[Event]) -> GpuTime | None:
    """The rank's GPU time over its whole window (None: no GPU work)."""
    work = [e for e in events if is_gpu_work(e)]
    if not work:
        return None
    return _time(_kinds(work), min(e.start_s for e in work), max(e.end_s for e in work))


def iteration_gpu_times(events: Sequence[Event]) -> dict[int, GpuTime]:
    """Per iteration of the rank's GPU work (by the ``iteration`` its launch
    fell in): its window runs to the next iteration's first activity."""
    work = [e for e in events if is_gpu_work(e) and "iteration" in e.args]
    if not work:
        return {}
    kinds = _kinds(work)
    first: dict[int, float] = {}
    last_end = max(e.end_s for e in work)
    for e in work:
        it = int(e.args["iteration"])
        first[it] = min(first.get(it, e.start_s), e.start_s)
    order = sorted(first, key=lambda it: first[it])
    bounds = [first[it] for it in order] + [last_end]
    return {it: _time(kinds, bounds[i], bounds[i + 1]) for i, it in enumerate(order)}


def gpu_times(events: Mapping[int, Sequence[Event]]) -> dict[int, GpuTime]:
    """Each rank's GPU time, for the ranks that have GPU work."""
    out = {}
    for rank, evs in events.items():
        t = rank_gpu_time(evs)
        if t is not None:
            out[rank] = t
    return out


def mean_idle_fraction(events: Mapping[int, Sequence[Event]]) -> float | None:
    """Mean over ranks and iterations of idle / window (the whole window of a
    rank without iterations); None where no rank has GPU work."""
    fractions: list[float] = []
    for evs in events.values():
        per_iteration = iteration_gpu_times(evs)
        whole = rank_gpu_time(evs)
        if per_iteration:
            fractions += [t.idle_fraction for t in per_iteration.values()]
        elif whole is not None:
            fractions.append(whole.idle_fraction)
    return sum(fractions) / len(fractions) if fractions else None

