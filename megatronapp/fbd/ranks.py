"""Virtual ranks (worker threads) and physical ranks (devices) of MegaFBD.

The forward and the backward instance each own the same set of virtual ranks,
numbered by Megatron's rules (``Topology``: tp fastest, then dp, then pp).
A *worker* is one (phase, virtual rank) thread: forward worker ``v`` has id
``v``, backward worker ``v`` has id ``N + v`` (N virtual ranks per instance),
so the coordinator's bit vectors span ``2N`` bits.

Physical devices are numbered forward instance first, then backward instance.
An instance with physical TP degree ``d`` (dividing the virtual tp) packs
``tp / d`` consecutive TP shards onto one device; its devices follow the same
Megatron order in the reduced topology. The co-located baseline puts both
workers of a virtual rank on one device.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from megatronapp.topology import Group, Topology

Phase = Literal["F", "B"]


@dataclass(frozen=True, slots=True, order=True)
class Worker:
    phase: Phase
    vrank: int

    def __str__(self) -> str:
        return f"{self.phase}{self.vrank}"


@dataclass(frozen=True)
class FbdLayout:
    """Where every worker thread runs.

    ``topo``: the virtual topology (both instances); ``forward_tp`` and
    ``backward_tp``: physical TP degrees; ``colocated``: baseline placement.
    """

    topo: Topology
    forward_tp: int
    backward_tp: int
    colocated: bool = False

    def __post_init__(self) -> None:
        for name in ("forward_tp", "backward_tp"):
            degree = getattr(self, name)
            if degree < 1 or self.topo.tp % degree:
                raise ValueError(f"{name} = {degree} must divide the virtual tp = {self.topo.tp}")
        if self.colocated and self.forward_tp != self.backward_tp:
            raise ValueError("co-located instances need forward_tp == backward_tp")

    # -------------------------------------------------------------- workers
    @property
    def virtual_ranks(self) -> int:
        return self.topo.world_size

    @property
    def num_workers(self) -> int:
        return 2 * self.virtual_ranks

    def worker_id(self, worker: Worker) -> int:
        return worker.vrank + (self.virtual_ranks if worker.phase == "B" else 0)

    def worker(self, worker_id: int) -> Worker:
        if not 0 <= worker_id < self.num_workers:
            raise ValueError(f"worker {worker_id} out of range 0..{self.num_workers - 1}")
        n = self.virtual_ranks
        return Worker("B", worker_id - n) if worker_id >= n else Worker("F", worker_id)

    # -------------------------------------------------------------- devices
    def _instance_topo(self, phase: Phase) -> Topology:
        degree = self.forward_tp if phase == "F" else self.backward_tp
        return Topology(tp=degree, pp=self.topo.pp, dp=self.topo.dp,
                        gpus_per_node=self.topo.gpus_per_node)

    @property
    def forward_devices(self) -> int:
        return self._instance_topo("F").world_size

    @property
    def backward_devices(self) -> int:
        return self._instance_topo("B").world_size

    @property
    def num_devices(self) -> int:
        if self.colocated:
            return self.forward_devices
        return self.forward_devices + self.backward_devices

    def threads_per_device(self, phase: Phase) -> int:
        degree = self.forward_tp if phase == "F" else self.backward_tp
        return self.topo.tp // degree

    def device_of(self, worker: Worker) -> int:
        c = self.topo.coord(worker.vrank)
        local = self._instance_topo(worker.phase).rank(
            c.dp, c.pp, c.tp // self.threads_per_device(worker.phase))
        if worker.phase == "B" and not self.colocated:
            return self.forward_devices + local
        return local

    def phase_of_device(self, device: int) -> str:
        if self.colocated:
            return "FB"
        return "F" if device < self.forward_devices else "B"

    @cached_property
    def workers_by_device(self) -> dict[int, tuple[int, ...]]:
        """device -> worker ids on it (ascending)."""
        out: dict[int, list[int]] = {d: [] for d in range(self.num_devices)}
        for wid in range(self.num_workers):
            out[self.device_of(self.worker(wid))].append(wid)
        return {d: tuple(ws) for d, ws in out.items()}

    def devices_of(self, worker_ids: Group) -> tuple[int, ...]:
        return tuple(sorted({self.device_of(self.worker(w)) for w in worker_ids}))

    def crosses_devices(self, worker_ids: Group) -> bool:
        """Only such groups need the coordinator; threads on one device share memory."""
        return len(self.devices_of(worker_ids)) > 1

    def same_device(self, a: Worker, b: Worker) -> bool:
        return self.device_of(a) == self.device_of(b)

    # ------------------------------------------------------------- printing
    def mapping_rows(self) -> list[dict[str, object]]:
        rows = []
        for device, wids in self.workers_by_device.items():
            rows.append({"device": device, "instance": self.phase_of_device(device),
                         "workers": [str(self.worker(w)) for w in wids]})
        return rows

    def format_mapping(self) -> str:
        lines = [f"virtual topology tp {self.topo.tp}, pp {self.topo.pp}, dp {self.topo.dp}: "
                 f"{self.virtual_ranks} virtual ranks per instance, {self.num_devices} devices "
                 f"(forward tp {self.forward_tp}, backward tp {self.backward_tp}"
                 f"{', co-located' if self.colocated else ''})"]
        for row in self.mapping_rows():
            workers = " ".join(row["workers"])  # type: ignore[arg-type]
            lines.append(f"device {row['device']} [{row['instance']}]: {workers}")
        return "\n".join(lines)


def collective_groups(layout: FbdLayout) -> tuple[Group, ...]:
    """Worker groups of the collectives that cross devices (the coordinator's
    groups), in a fixed order every process computes alike: forward TP,
    backward TP, backward DP."""
    topo, n = layout.topo, layout.virtual_ranks
    candidates = [tuple(g) for g in topo.tp_groups]
    candidates += [tuple(v + n for v in g) for g in topo.tp_groups]
    candidates += [tuple(v + n for v in g) for g in topo.dp_groups]
    return tuple(g for g in candidates if len(g) > 1 and layout.crosses_devices(g))
