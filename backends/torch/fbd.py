"""MegaFBD on torch.distributed: one process per device, worker threads inside.

Each process (a physical rank) runs its workers (``megatronapp.fbd.workers``
programs) as threads and one control thread. Workers on the same device pass
tensors through an in-process mailbox (shared memory). Every cross-device
operation, p2p or collective, is a request to the control thread: the worker
sets its bit in the ``Coordinator`` and blocks; the control thread aligns the
tables of all processes with ``dist.all_reduce`` (``TorchTransport``), then
runs the ready operations in ascending group order with blocking gloo/NCCL
calls. All processes run the same ready list in the same order, so blocking
send/recv pairs and collectives always meet.

Optionally each worker's operations are recorded (``tracers``, times from
``now``) and injected faults act on this device (``faults``, an
``InjectedFaults`` over physical devices): a throttled compute sleeps the extra
time its CPU work would take; the control thread sleeps what a slow link or a
slow collective would add after it.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch
import torch.distributed as dist

from megatronapp.fbd.coordinator import Coordinator, GroupTable, Launch
from megatronapp.fbd.ranks import FbdLayout, Worker
from megatronapp.fbd.transport import Encoding, TorchTransport
from megatronapp.ops import AllReduce, Compute, IRecv, ISend, Op, RankProgram, Recv, Send, Wait
from megatronapp.tracer import Tracer

IDLE_WAIT_S = 2e-3  # a control thread with nothing registered naps this long per round


def p2p_groups(layout: FbdLayout) -> tuple[tuple[int, int], ...]:
    """Worker pairs that exchange tensors: forward act, stage input, grads, weights."""
    topo, pairs = layout.topo, set()
    for v in range(layout.virtual_ranks):
        f, b = layout.worker_id(Worker("F", v)), layout.worker_id(Worker("B", v))
        pairs.add(tuple(sorted((f, b))))
        if topo.coord(v).pp + 1 < topo.pp:
            nxt = topo.pp_neighbor(v, 1)
            pairs.add(tuple(sorted((f, layout.worker_id(Worker("F", nxt))))))
            pairs.add(tuple(sorted((b, layout.worker_id(Worker("B", nxt))))))
    return tuple(sorted(p for p in pairs if layout.crosses_devices(p)))


def coordinator_table(layout: FbdLayout, collectives: tuple[tuple[int, ...], ...]) -> GroupTable:
    return GroupTable(tuple(p2p_groups(layout)) + collectives, layout.num_workers)


def nbytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


def op_args(op: Op, result: Any) -> dict[str, Any]:
    """Trace args of a completed op: p2p ops name their peer, collectives their group."""
    args: dict[str, Any] = dict(getattr(op, "meta", {}))
    if isinstance(op, (ISend, Send)):
        args.update(bytes=nbytes(op.tensor), peer=op.dst)
    elif isinstance(op, (IRecv, Recv)):
        value = result.value if isinstance(result, Done) else result
        args.update(bytes=nbytes(value), peer=op.src)
    elif isinstance(op, AllReduce):
        args.update(bytes=nbytes(op.tensor), group=list(op.group))
    return args


@dataclass(eq=False)
class Request:
    """One worker's side of a cross-device operation."""

    kind: str  # "send" | "recv" | "allreduce"
    tensor: Any
    peer: int = -1  # worker id (p2p)
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class Done:
    """A completed operation, the handle ISend/IRecv resume with."""

    value: Any


class Mailbox:
    """Same-device tensors between worker threads (shared memory)."""

    def __init__(self) -> None:
        self._items: dict[tuple[int, int, Hashable], list[Any]] = defaultdict(list)
        self._cv = threading.Condition()

    def put(self, key: tuple[int, int, Hashable], value: Any) -> None:
        with self._cv:
            self._items[key].append(value)
            self._cv.notify_all()

    def get(self, key: tuple[int, int, Hashable]) -> Any:
        with self._cv:
            self._cv.wait_for(lambda: bool(self._items[key]))
            return self._items[key].pop(0)


class DeviceRuntime:
    """One process: its worker threads, its coordinator, its control thread."""

    def __init__(self, layout: FbdLayout, device: int, table: GroupTable,
                 recv_like: Callable[[int, Hashable], torch.Tensor], encoding: Encoding = "bits",
                 tracers: dict[int, Tracer] | None = None, faults: Any = None,
                 now: Callable[[], float] = time.perf_counter):
        self.layout, self.device, self.table = layout, device, table
        self.tracers, self.faults, self.now = tracers or {}, faults, now
        self.workers = layout.workers_by_device[device]
        self.coordinator = Coordinator(table, self.workers)
        self.transport = TorchTransport(len(table), table.width, encoding)
        self.recv_like = recv_like
        self.mailbox = Mailbox()
        self._lock = threading.Lock()
        self._requests: dict[tuple[int, int], Request] = {}
        self._gid = {g: i for i, g in enumerate(table.groups)}
        self._p2p = frozenset(p2p_groups(layout))
        self._device_groups = self._make_device_groups()
        self._active = len(self.workers)
        self.errors: list[BaseException] = []
        self.rounds = 0

    def _make_device_groups(self) -> dict[int, Any]:
        """A process group per collective's device set, created alike everywhere."""
        out: dict[int, Any] = {}
        made: dict[tuple[int, ...], Any] = {}
        for gid, members in enumerate(self.table.groups):
            if members in self._p2p:
                continue
            devices = self.layout.devices_of(members)
            if devices not in made:
                made[devices] = dist.new_group(list(devices))
            out[gid] = made[devices]
        return out

    def device_of(self, worker: int) -> int:
        return self.layout.device_of(self.layout.worker(worker))

    # ---------------------------------------------------- worker side
    def request(self, worker: int, members: tuple[int, ...], req: Request) -> Any:
        gid = self._gid[members]
        with self._lock:
            self.coordinator.register(worker, gid)
            self._requests[(worker, gid)] = req
        req.done.wait()
        return req.tensor

    def interpret(self, worker: int, program: RankProgram) -> None:
        """Run one worker program in this thread."""
        try:
            result: Any = None
            while True:
                try:
                    op = program.send(result)
                except StopIteration:
                    return
                result = self._timed(worker, op)
        except BaseException as err:  # surfaced by the launcher
            self.errors.append(err)
            raise
        finally:
            with self._lock:
                self._active -= 1

    def _timed(self, worker: int, op: Op) -> Any:
        """Run an op; throttle a compute if this device is slowed; record it."""
        if isinstance(op, Wait):  # sends complete before their handle exists
            return self._op(worker, op)
        start, cpu = self.now(), time.thread_time()
        result = self._op(worker, op)
        if isinstance(op, Compute) and self.faults is not None:
            done = min(time.thread_time() - cpu, self.now() - start)  # CPU work, not waiting
            time.sleep(max(0.0, self.faults.compute_extra_s(start, done)))
        tracer = self.tracers.get(worker)
        if tracer is not None:
            tracer.record(op.name, start, self.now(), op_args(op, result))
        return result

    def _op(self, worker: int, op: Any) -> Any:
        if isinstance(op, Compute):
            return op.run() if op.run is not None else None
        if isinstance(op, (ISend, Send)):
            self._send(worker, op)
            return Done(None)
        if isinstance(op, (IRecv, Recv)):
            value = self._recv(worker, op)
            return value if isinstance(op, Recv) else Done(value)
        if isinstance(op, Wait):
            return op.handle.value
        if isinstance(op, AllReduce):
            return self.request(worker, tuple(op.group), Request("allreduce", op.tensor))
        raise TypeError(f"worker {worker}: unsupported operation {type(op).__name__}")

    def _send(self, worker: int, op: ISend | Send) -> None:
        if self.device_of(op.dst) == self.device:
            self.mailbox.put((worker, op.dst, op.tag), op.tensor)
        else:  # blocks until the control thread has sent it
            self.request(worker, tuple(sorted((worker, op.dst))),
                         Request("send", op.tensor.contiguous(), op.dst))

    def _recv(self, worker: int, op: IRecv | Recv) -> Any:
        if self.device_of(op.src) == self.device:
            return self.mailbox.get((op.src, worker, op.tag))
        return self.request(worker, tuple(sorted((worker, op.src))),
                            Request("recv", torch.empty_like(self.recv_like(worker, op.tag)),
                                    op.src))

    # --------------------------------------------------- control side
    def control_loop(self) -> None:
        """Align with every other process each round until no one has work."""
        while True:
            with self._lock:
                snapshot = self.coordinator.begin_round()
                active = self._active > 0
            exchange = self.transport.exchange(snapshot, active)
            with self._lock:
                launches = self.coordinator.finish_round(exchange.merged)
            self.rounds += 1
            for launch in launches:  # ascending group order
                self._execute(launch)
            if not exchange.anyone_active:
                return
            if not launches and not any(snapshot):
                threading.Event().wait(IDLE_WAIT_S)

    def _execute(self, launch: Launch) -> None:
        with self._lock:
            reqs = [self._requests.pop((w, launch.group)) for w in launch.local]
        if launch.group in self._device_groups:
            self._allreduce(launch.group, reqs)
        else:
            (req,) = reqs
            peer = self.device_of(req.peer)
            if req.kind == "send":
                dist.send(req.tensor, dst=peer, tag=launch.group)
            else:
                dist.recv(req.tensor, src=peer, tag=launch.group)
                if self.faults is not None:  # the receiver waits out a slow link
                    time.sleep(self.faults.transfer_extra_s(peer, self.device, nbytes(req.tensor)))
        for req in reqs:
            req.done.set()

    def _allreduce(self, gid: int, reqs: list[Request]) -> None:
        total = reqs[0].tensor
        for req in reqs[1:]:  # local members first, through shared memory
            total.add_(req.tensor)
        dist.all_reduce(total, group=self._device_groups[gid])
        if self.faults is not None:
            devices = self.layout.devices_of(self.table.groups[gid])
            time.sleep(self.faults.allreduce_extra_s(devices, nbytes(total)))
        for req in reqs[1:]:
            req.tensor.copy_(total)

    def run(self, programs: dict[int, RankProgram]) -> None:
        threads = [threading.Thread(target=self.interpret, args=(w, programs[w]), daemon=True,
                                    name=f"worker-{w}") for w in self.workers]
        for t in threads:
            t.start()
        self.control_loop()
        for t in threads:
            t.join()
        if self.errors:
            raise self.errors[0]

