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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np

from ..trace import metrics
from ..trace.columns import EventColumns, EventSource, columns_from_events
from ..trace.events import Event
from ..trace.totals import RunTotals, WeightedMean, fed

if TYPE_CHECKING:
    from ..scenario.config import Scenario

Events = Mapping[int, Sequence[Event]]
PHASE_NAMES = metrics.PHASES


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


def _table(events: Events) -> tuple[EventColumns, np.ndarray]:
    cols = columns_from_events(events)
    return cols, metrics.unit_weights(cols)


def send_windows(events: Events) -> list[SendWindow]:
    """Each message matched to the consumer task that needs it (see
    ``metrics.send_windows``)."""
    w = metrics.send_windows(*_table(events))
    return [SendWindow(int(w.src[i]), int(w.dst[i]), int(w.iteration[i]), int(w.microbatch[i]),
                       PHASE_NAMES[w.phase[i]], int(w.nbytes[i]), float(w.window_s[i]),
                       float(w.transfer_s[i])) for i in range(len(w.src))]


def allreduce_windows(events: Iterable[Event]) -> list[float]:
    """One rank: per iteration and chunk, last backward end -> optimizer start."""
    windows, _w = metrics.allreduce_windows(*_table({0: list(events)}))
    return [float(x) for x in windows]


@dataclass(frozen=True)
class WindowMetrics:
    p2p_send_window_s: float  # mean over messages
    p2p_exposed_s: float  # mean time a consumer could not start for lack of data
    allreduce_window_s: float  # mean over ranks, chunks and iterations
    compute_ratio: float  # compute busy time / iteration time, mean over ranks x iterations
    p2p_bandwidth_demand_gbps: float  # mean message size / mean window, in Gbit/s
    peak_live_slots: int  # most stored activations on any rank

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class WindowTotals:
    """``WindowMetrics`` accumulated batch by batch (each batch whole
    pipelines: a message, its receive and the task that needs it together)."""

    def __init__(self) -> None:
        self.run = RunTotals()
        self.window, self.exposed, self.nbytes, self.allreduce = (
            WeightedMean(), WeightedMean(), WeightedMean(), WeightedMean())
        self.peaks: dict[int, int] = {}

    def add(self, cols: EventColumns, weight: np.ndarray) -> None:
        sends = metrics.send_windows(cols, weight)
        self.window.add(sends.window_s, sends.weight)
        self.nbytes.add(sends.nbytes.astype(float), sends.weight)
        self.exposed.add(np.maximum(sends.transfer_s - sends.window_s, 0.0), sends.weight)
        self.allreduce.add(*metrics.allreduce_windows(cols, weight))
        self.peaks.update(metrics.live_slot_peaks(cols))
        self.run.add(cols, weight)

    def metrics(self) -> WindowMetrics:
        mean_window = self.window.value()
        return WindowMetrics(
            p2p_send_window_s=mean_window,
            p2p_exposed_s=self.exposed.value(),
            allreduce_window_s=self.allreduce.value(),
            compute_ratio=1.0 - self.run.bubble_fraction(),
            p2p_bandwidth_demand_gbps=(self.nbytes.value() * 8 / 1e9 / mean_window
                                       if mean_window > 0 else 0.0),
            peak_live_slots=max(self.peaks.values(), default=0))


def window_metrics_columns(cols: EventColumns, weight: np.ndarray) -> WindowMetrics:
    totals = WindowTotals()
    totals.add(cols, weight)
    return totals.metrics()


def window_metrics(events: Events) -> WindowMetrics:
    return window_metrics_columns(*_table(events))


def dpp_summary(s: "Scenario", events: Events) -> dict[str, Any]:
    """The ``dpp`` section of summary.json: windows and peak memory in bytes."""
    return fed(DppTotals(s, {r: (r,) for r in events}), [_table(events)])


def dpp_summary_source(s: "Scenario", source: EventSource) -> dict[str, Any]:
    """The ``dpp`` section of a run's event source, a few pipelines at a time."""
    return fed(DppTotals(s, source.stand_ins()), source.weighted_batches())


class DppTotals:
    """The ``dpp`` section accumulated batch by batch: windows and per-rank
    peak memory; ``stand_ins`` maps each rank of the rows to the ranks whose
    identical timeline it stands for."""

    def __init__(self, s: "Scenario", stand_ins: Mapping[int, Sequence[int]]):
        self.scenario, self.stand_ins = s, stand_ins
        self.windows = WindowTotals()

    def add(self, cols: EventColumns, weight: np.ndarray) -> None:
        self.windows.add(cols, weight)

    def finish(self) -> dict[str, Any]:
        from ..costs.per_op import stage_costs
        from ..program.layout import pipe_shape
        from .memory import MemoryModel

        s = self.scenario
        memory = MemoryModel.of(s, stage_costs(s), pipe_shape(s))
        peaks = self.windows.peaks
        per_rank = {r: memory.bytes_for(peaks.get(rep, 0)) for rep, ranks in self.stand_ins.items()
                    for r in ranks}
        return {**self.windows.metrics().as_dict(),
                "peak_memory_bytes": max(per_rank.values(), default=0),
                "peak_memory_bytes_per_rank": {str(r): per_rank[r] for r in sorted(per_rank)},
                "memory_capacity_bytes": memory.capacity_bytes}
