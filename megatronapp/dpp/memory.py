"""Per-rank memory accounting in units of stored activations ("slots").

One slot is what one microbatch leaves behind on one model chunk for its
backward pass (``StageCosts.activation_mem_bytes_per_chunk``). A rank's memory
is its model and optimizer state, a pre-allocated pool for the four P2P
buffers, and the slots alive at that moment. A slot is taken when a forward
starts and released when the matching backward ends.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ..scenario.config import Scenario, ScenarioError
from ..costs.per_op import StageCosts
from ..parallel.schedules import Order, PipeShape
from ..trace.events import Event

GB = 1e9
BUFFERS = 4  # forward received, forward to send, backward received, backward to send


@dataclass(frozen=True)
class MemoryModel:
    capacity_bytes: int
    model_bytes: int  # parameters, gradients and optimizer state
    buffer_pool_bytes: int  # room for every P2P message of one iteration
    slot_bytes: int  # one microbatch's stored activations on one chunk
    transient_bytes: int = 0  # what recomputation rebuilds for one layer during backward

    @classmethod
    def of(cls, s: Scenario, costs: StageCosts, shape: PipeShape) -> "MemoryModel":
        # Each buffer holds at most one message per task of the iteration.
        pool = BUFFERS * shape.microbatches * shape.vpp * costs.activation_bytes
        return cls(capacity_bytes=int(s.cluster.gpu.memory_gb * GB),
                   model_bytes=costs.model_mem_bytes, buffer_pool_bytes=pool,
                   slot_bytes=max(costs.activation_mem_bytes_per_chunk, 1),
                   transient_bytes=costs.transient_mem_bytes)

    @property
    def fixed_bytes(self) -> int:
        return self.model_bytes + self.buffer_pool_bytes + self.transient_bytes

    def bytes_for(self, live_slots: int) -> int:
        return self.fixed_bytes + live_slots * self.slot_bytes

    @property
    def slot_cap(self) -> int:
        """How many slots fit next to the model and the buffer pool."""
        free = self.capacity_bytes - self.fixed_bytes
        return max(free // self.slot_bytes, 0)


class MemoryExceeded(ScenarioError):
    """A schedule needs more memory on some rank than its device has."""

    def __init__(self, schedule: str, rank: int, pp_rank: int, peak_bytes: int, capacity_bytes: int,
                 hint: str = ""):
        super().__init__("cluster.gpu.memory_gb",
                         f"schedule {schedule} needs {peak_bytes / GB:.2f} GB on rank {rank} "
                         f"(pipeline stage {pp_rank}) at its peak, the device has "
                         f"{capacity_bytes / GB:.2f} GB" + (f"; {hint}" if hint else ""))
        self.schedule = schedule
        self.pp_rank = pp_rank
        self.capacity_bytes = capacity_bytes
        self.rank = rank
        self.peak_bytes = peak_bytes


def order_live_slots(order: Order) -> list[int]:
    """Live slots right after each task of a static order starts."""
    live, out = 0, []
    for task in order:
        if task.phase == "F":
            live += 1
            out.append(live)
        else:
            out.append(live)
            live -= 1
    return out


def order_peak_slots(order: Order) -> int:
    return max(order_live_slots(order), default=0)


def trace_live_slots(events: Iterable[Event]) -> list[tuple[float, int]]:
    """(time, live slots) steps of one rank from its forward/backward events."""
    # A task split into pieces (around its collectives) starts with part 0, ends with its last.
    steps = [(e.start_s, +1) for e in events if e.name == "forward" and e.args.get("part", 0) == 0]
    steps += [(e.end_s, -1) for e in events if e.name == "backward"
              and e.args.get("part", 0) == e.args.get("parts", 1) - 1]
    # At equal times (to 10 ns: traces round to µs/1000) a release sorts first.
    steps.sort(key=lambda step: (round(step[0], 8), step[1]))
    live, out = 0, []
    for t, delta in steps:
        live += delta
        out.append((t, live))
    return out


def trace_peak_slots(events: Sequence[Event]) -> int:
    from ..trace.columns import columns_from_events
    from ..trace.metrics import live_slot_peaks

    return live_slot_peaks(columns_from_events({0: list(events)})).get(0, 0)
