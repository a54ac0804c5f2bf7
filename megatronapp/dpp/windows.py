"""Window metrics computed from trace events alone (any backend, any run dir).

* P2P send window: from an output being ready (its send is posted) to the
  moment its consumer starts the task that needs it. The longer, the more
  time the transfer has to hide behind compute; ``bytes / window`` is the
  bandwidth a link needs to deliver it in time.
* All-reduce window: from a chunk's last backward on a rank to that rank's
  optimizer step: the time that chunk's gradient sync could overlap.
* Compute ratio: forward/backward/optimizer busy time over iteration time.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from statistics import fmean
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from ..summary import compute_busy, iteration_spans
from ..tracer import Event
from .memory import trace_peak_slots

if TYPE_CHECKING:
    from ..config import Scenario

Events = Mapping[int, Sequence[Event]]
PHASE_OF = {"send_forward": "forward", "send_backward": "backward",
            "recv_forward": "forward", "recv_backward": "backward"}


@dataclass(frozen=True)
class SendWindow:
    src: int
    dst: int
    iteration: int
    microbatch: int
    phase: str
    nbytes: int
    window_s: float
    transfer_s: float


TASK_ARGS = ("iteration", "microbatch", "chunk")  # what pairs a message with its task


def _tagged(e: Event, *keys: str) -> bool:
    """Whether ``e`` carries our trace arguments (foreign traces may not)."""
    return all(e.args.get(k) is not None for k in keys)


def _key(e: Event, rank_a: int, rank_b: int) -> tuple:
    return (rank_a, rank_b, PHASE_OF[e.name], e.args["iteration"], e.args["microbatch"])


def send_windows(events: Events) -> list[SendWindow]:
    """Match each send to the consumer's compute task through the receive.

    Between two ranks, sends of one microbatch and phase map to receives in
    increasing chunk order on both sides (virtual stage v feeds v +/- 1), so
    sorting both by chunk pairs them.
    """
    sends: dict[tuple, list[Event]] = defaultdict(list)
    recvs: dict[tuple, list[Event]] = defaultdict(list)
    starts: dict[tuple, float] = {}
    for rank, rank_events in events.items():
        for e in rank_events:
            if e.name in PHASE_OF and not _tagged(e, "peer", *TASK_ARGS):
                continue
            if e.name.startswith("send_") and e.name in PHASE_OF:
                sends[_key(e, rank, e.args["peer"])].append(e)
            elif e.name.startswith("recv_") and e.name in PHASE_OF:
                recvs[_key(e, e.args["peer"], rank)].append(e)
            elif e.name in ("forward", "backward") and _tagged(e, *TASK_ARGS):
                starts[(rank, e.name, e.args["iteration"], e.args["microbatch"],
                        e.args["chunk"])] = e.start_s
    out = []
    for key, key_sends in sends.items():
        src, dst, phase, it, mb = key
        pairs = zip(sorted(key_sends, key=lambda e: e.args["chunk"]),
                    sorted(recvs.get(key, []), key=lambda e: e.args["chunk"]))
        for send, recv in pairs:
            needed = starts.get((dst, phase, it, mb, recv.args["chunk"]))
            if needed is not None:
                out.append(SendWindow(src, dst, it, mb, phase, int(send.args.get("bytes", 0)),
                                      needed - send.start_s, send.dur_s))
    return out


def allreduce_windows(events: Iterable[Event]) -> list[float]:
    """One rank: per iteration and chunk, last backward end -> optimizer start."""
    last_bwd: dict[tuple[int, int], float] = {}
    optimizer: dict[int, float] = {}
    for e in events:
        it = e.args.get("iteration")
        if it is None:
            continue
        if e.name == "backward":
            key = (it, e.args.get("chunk", 0))  # foreign traces carry no chunk
            last_bwd[key] = max(last_bwd.get(key, e.end_s), e.end_s)
        elif e.name == "optimizer":
            optimizer[it] = e.start_s
    return [optimizer[it] - end for (it, _c), end in last_bwd.items() if it in optimizer]


def compute_ratio(events: Events) -> float:
    spans = iteration_spans(events)
    ratios = [busy.get(it, 0.0) / (hi - lo)
              for busy in (compute_busy(ev) for ev in events.values())
              for it, (lo, hi) in spans.items() if hi > lo]
    return fmean(ratios) if ratios else 0.0


@dataclass(frozen=True)
class WindowMetrics:
    p2p_send_window_s: float  # mean over messages
    p2p_exposed_s: float  # mean time a consumer could not start for lack of data
    allreduce_window_s: float  # mean over ranks, chunks and iterations
    compute_ratio: float
    p2p_bandwidth_demand_gbps: float  # mean message size / mean window, in Gbit/s
    peak_live_slots: int  # most stored activations on any rank

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def window_metrics(events: Events) -> WindowMetrics:
    sends = send_windows(events)
    ar = [w for ev in events.values() for w in allreduce_windows(ev)]
    mean_window = fmean(s.window_s for s in sends) if sends else 0.0
    mean_bytes = fmean(s.nbytes for s in sends) if sends else 0.0
    return WindowMetrics(
        p2p_send_window_s=mean_window,
        p2p_exposed_s=fmean(max(s.transfer_s - s.window_s, 0.0) for s in sends) if sends else 0.0,
        allreduce_window_s=fmean(ar) if ar else 0.0,
        compute_ratio=compute_ratio(events),
        p2p_bandwidth_demand_gbps=mean_bytes * 8 / 1e9 / mean_window if mean_window > 0 else 0.0,
        peak_live_slots=max((trace_peak_slots(ev) for ev in events.values()), default=0))


def dpp_summary(s: "Scenario", events: Events) -> dict[str, Any]:
    """The ``dpp`` section of summary.json: windows and peak memory in bytes."""
    from ..costs import stage_costs
    from ..layout import pipe_shape
    from .memory import MemoryModel

    memory = MemoryModel.of(s, stage_costs(s), pipe_shape(s))
    per_rank = {str(r): memory.bytes_for(trace_peak_slots(ev)) for r, ev in sorted(events.items())}
    return {**window_metrics(events).as_dict(),
            "peak_memory_bytes": max(per_rank.values(), default=0),
            "peak_memory_bytes_per_rank": per_rank,
            "memory_capacity_bytes": memory.capacity_bytes}
