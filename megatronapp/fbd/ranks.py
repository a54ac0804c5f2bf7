"""Virtual ranks (worker threads) and physical ranks (devices) of MegaFBD.

The forward and the backward instance each own the same set of virtual ranks,
numbered by Megatron's rules (``Topology``: tp fastest, then dp, then pp).
A *worker* is one (phase, virtual rank) thread: forward worker ``v`` has id
``v``, backward worker ``v`` has id ``N + v`` (N virtual ranks per instance),
so the coordinator's bit vectors span ``2N`` bits.

Physical devices are numbered forward instance first, then backward instance.
An instance with physical TP degree ``d`` (dividing the virtual tp) packs
``tp / d`` consecutive TP shards onto one device; its devices follow the same
Megatron order in the reduced topology.

On torch every worker is a process of its own. megatron-core keeps its
parallel state in process globals, so a process holds one model; with
``2N`` processes, ``initialize_model_parallel(tp, pp)`` sees a data-parallel
degree of ``2·dp``. ``process_rank`` folds the phase into that degree (rank
``tp + T·((phase·D + dp) + 2D·pp)``), so each of megatron's TP and PP groups
holds workers of one instance only.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from megatronapp.parallel.topology import Group, Topology

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
    ``backward_tp``: physical TP degrees.
    """

    topo: Topology
    forward_tp: int
    backward_tp: int

    def __post_init__(self) -> None:
        for name in ("forward_tp", "backward_tp"):
            degree = getattr(self, name)
            if degree < 1 or self.topo.tp % degree:
                raise ValueError(f"{name} = {degree} must divide the virtual tp = {self.topo.tp}")

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
        return self.forward_devices + self.backward_devices

    def threads_per_device(self, phase: Phase) -> int:
        degree = self.forward_tp if phase == "F" else self.backward_tp
        return self.topo.tp // degree

    def device_of(self, worker: Worker) -> int:
        c = self.topo.coord(worker.vrank)
        local = self._instance_topo(worker.phase).rank(
            c.dp, c.pp, c.tp // self.threads_per_device(worker.phase))
        return local + (self.forward_devices if worker.phase == "B" else 0)

    def phase_of_device(self, device: int) -> str:
        return "F" if device < self.forward_devices else "B"

    # ------------------------------------------------------------ processes
    def process_rank(self, worker_id: int) -> int:
        """The worker's torch.distributed rank: megatron order with the phase
        folded into the data-parallel index."""
        worker = self.worker(worker_id)
        c, t = self.topo.coord(worker.vrank), self.topo
        dp = c.dp + (t.dp if worker.phase == "B" else 0)
        return c.tp + t.tp * (dp + 2 * t.dp * c.pp)

    def worker_of_process(self, rank: int) -> int:
        t = self.topo
        tp, rest = rank % t.tp, rank // t.tp
        dp, pp = rest % (2 * t.dp), rest // (2 * t.dp)
        phase = "B" if dp >= t.dp else "F"
        return self.worker_id(Worker(phase, t.rank(dp % t.dp, pp, tp)))  # type: ignore[arg-type]

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
                 f"(forward tp {self.forward_tp}, backward tp {self.backward_tp})"]
        for row in self.mapping_rows():
            workers = " ".join(row["workers"])  # type: ignore[arg-type]
            lines.append(f"device {row['device']} [{row['instance']}]: {workers}")
        ranks = ", ".join(f"{self.worker(w)} {self.process_rank(w)}"
                          for w in range(self.num_workers))
        lines.append(f"torch process rank of each worker: {ranks}")
        return "\n".join(lines)


def p2p_pairs(layout: FbdLayout) -> tuple[Group, ...]:
    """Worker pairs that exchange tensors across devices: forward activations,
    stage inputs and weights (forward <-> backward worker), input gradients."""
    topo, pairs = layout.topo, set()
    for v in range(layout.virtual_ranks):
        f, b = layout.worker_id(Worker("F", v)), layout.worker_id(Worker("B", v))
        pairs.add((f, b))
        if topo.coord(v).pp + 1 < topo.pp:
            nxt = topo.pp_neighbor(v, 1)
            pairs.add((f, layout.worker_id(Worker("F", nxt))))
            pairs.add((b, layout.worker_id(Worker("B", nxt))))
    return tuple(sorted(tuple(sorted(p)) for p in pairs if layout.crosses_devices(p)))


def coordinated_groups(layout: FbdLayout) -> tuple[Group, ...]:
    """The coordinator's groups, in one order every process computes alike:
    the cross-device p2p pairs, then the backward instance's DP groups. TP
    collectives are not among them: they run inside the model's layers
    (megatron-core's TP group on torch), among shards of one instance."""
    n = layout.virtual_ranks
    dp = [tuple(v + n for v in g) for g in layout.topo.dp_groups if len(g) > 1]
    return p2p_pairs(layout) + tuple(g for g in dp if layout.crosses_devices(g))
