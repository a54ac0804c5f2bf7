"""MegaFBD's differences from a plain torch run: coordinated transfers.

A MegaFBD worker (the forward or the backward worker of a virtual rank) is a
process of its own. Its program runs in the main thread on the one
``Interpreter``; ``CoordinatedInterpreter`` only changes where p2p operations
and the program's all-reduces go: they name peers by worker id, and every one
of them crosses devices, so each becomes a request to this process's control
thread (``ControlThread``) and resumes with a handle, exactly like a plain
``isend``/``irecv`` (``Wait``/``WaitAny`` work unchanged).

The control thread runs the production round loop
(``megatronapp.fbd.control.control_thread``): an OR all-reduce of the
coordinator's table over every worker process (``TorchTransport``), then the
ready operations in ascending group order with blocking ``dist.send`` /
``dist.recv`` / ``dist.all_reduce``. Every process computes the same ready
list in the same order, so the blocking calls always meet.

The control thread uses process groups of its own (two over all worker
processes: the table's, on gloo, and the transfers'; one per DP group); the
model's TP collectives run in the main
thread on megatron-core's TP group. Each process group has its own
connections and its own queue of work, and on each of them every member
issues the same sequence (the program's order for TP, the coordinator's
global order for the control groups), so the two threads never wait on each
other's communication.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch
import torch.distributed as dist

from megatronapp.fbd.control import Align, Aligned, Execute, Nap, Requests, control_thread
from megatronapp.fbd.coordinator import Coordinator, GroupTable
from megatronapp.fbd.ranks import FbdLayout, p2p_pairs
from megatronapp.fbd.transport import Encoding, decode, encode
from megatronapp.parallel.ops import AllReduce, encode_tag
from megatronapp.parallel.topology import Group
from sim import InjectedFaults

from .interpreter import Handle, Interpreter, sleep_s


class TorchTransport:
    """The OR all-reduce as ``dist.all_reduce`` of the encoded table over a
    process group (MAX for ``bits``, SUM for ``words``)."""

    def __init__(self, table: GroupTable, encoding: Encoding, group: Any):
        self.groups, self.width = len(table), table.width
        self.encoding, self.group = encoding, group

    def exchange(self, table: Sequence[int], active: bool) -> Aligned:
        flat = encode(table, self.width, self.encoding) + [int(active)]
        tensor = torch.tensor(flat, dtype=torch.int64)
        op = dist.ReduceOp.MAX if self.encoding == "bits" else dist.ReduceOp.SUM
        dist.all_reduce(tensor, op=op, group=self.group)
        values = tensor.tolist()
        return Aligned(decode(values[:-1], self.groups, self.width, self.encoding),
                       values[-1] > 0)


@dataclass(eq=False)
class Request:
    """One worker's side of a coordinated operation; the interpreter's
    handles hold it as their work (``wait`` / ``is_completed``)."""

    kind: str  # "send" | "recv" | "allreduce"
    tensor: torch.Tensor
    peer: int = -1  # worker id (p2p)
    tag: Hashable = None
    done: threading.Event = field(default_factory=threading.Event)
    failure: list[BaseException] = field(default_factory=list)  # the control thread's
    injected_s: float | None = None  # what a link fault added (None: no link faults)

    def wait(self) -> None:
        self.done.wait()
        if self.failure:
            raise self.failure[0]

    def is_completed(self) -> bool:
        return self.done.is_set()


class ControlThread:
    """One worker process's coordinator, its requests and its control thread."""

    def __init__(self, layout: FbdLayout, worker: int, table: GroupTable, nap_s: float,
                 faults: InjectedFaults, encoding: Encoding = "words"):
        self.layout, self.worker, self.table, self.nap_s = layout, worker, table, nap_s
        self.faults = faults
        self.device = layout.device_of(layout.worker(worker))
        self.requests = Requests[Request](Coordinator(table, [worker]))
        self._gid = {g: i for i, g in enumerate(table.groups)}
        self._lock = threading.Lock()
        self._working = True
        self._failure: list[BaseException] = []
        self._open: set[Request] = set()
        # made in one order by every process: the table's (a CPU tensor, gloo
        # on any job), the transfers' (the job's backend), each DP group's
        everyone = list(range(layout.num_workers))
        table_group = dist.new_group(everyone, backend="gloo")
        self.group = dist.new_group(everyone)
        pairs = set(p2p_pairs(layout))
        self._collective_groups = {
            gid: dist.new_group(sorted(layout.process_rank(w) for w in members))
            for gid, members in enumerate(table.groups) if members not in pairs}
        self.transport = TorchTransport(table, encoding, table_group)
        self.rounds = 0
        self.align_s = 0.0  # wall time in the alignment all-reduces
        self.executions = 0
        self.execute_s = 0.0  # wall time running launched operations
        self._thread = threading.Thread(target=self._run, daemon=True, name="fbd-control")

    # ------------------------------------------------------ worker side
    def post(self, kind: str, members: Group, tensor: torch.Tensor, peer: int = -1,
             tag: Hashable = None) -> Request:
        gid = self._gid.get(tuple(sorted(members)))
        if gid is None:
            raise ValueError(f"worker {self.worker}: {kind} with workers {sorted(members)} "
                             "is not a cross-device operation of this layout")
        request = Request(kind, tensor, peer, tag, failure=self._failure)
        with self._lock:
            if self._failure:
                raise self._failure[0]
            self._open.add(request)
            self.requests.post(self.worker, gid, request)
        return request

    def start(self) -> None:
        self._thread.start()

    def finish(self) -> None:
        """The worker program has ended: stop once every process is done."""
        with self._lock:
            self._working = False
        self._thread.join()
        if self._failure:
            raise self._failure[0]

    # ----------------------------------------------------- control side
    def _run(self) -> None:
        program = control_thread(self.requests, lambda: self._working, self.nap_s,
                                 guard=lambda: self._lock)
        reply: Any = None
        try:
            while True:
                try:
                    op = program.send(reply)
                except StopIteration:
                    return
                reply = self._interpret(op)
        except BaseException as err:  # surfaced in the worker's thread by every request
            with self._lock:
                self._failure.append(err)
                for request in self._open:
                    request.done.set()

    def _interpret(self, op: Any) -> Any:
        start = time.perf_counter()
        if isinstance(op, Align):
            reply = self.transport.exchange(op.table, op.active)
            self.rounds += 1
            self.align_s += time.perf_counter() - start
            return reply
        if isinstance(op, Execute):
            (request,) = op.requests  # this process serves one worker
            self._execute(op.launch.group, request)
            self.executions += 1
            self.execute_s += time.perf_counter() - start
            with self._lock:
                self._open.discard(request)
            request.done.set()
            return None
        if isinstance(op, Nap):
            time.sleep(op.seconds)
            return None
        raise TypeError(f"unknown control operation {op!r}")

    def _execute(self, gid: int, request: Request) -> None:
        nbytes = request.tensor.numel() * request.tensor.element_size()
        if request.kind == "allreduce":
            if self.faults.links:
                devices = self.layout.devices_of(self.table.groups[gid])
                request.injected_s = sleep_s(self.faults.allreduce_extra_s(devices, nbytes))
            dist.all_reduce(request.tensor, group=self._collective_groups[gid])
            return
        peer = self.layout.process_rank(request.peer)
        tag = encode_tag(request.tag)
        if request.kind == "send":
            dist.send(request.tensor, dst=peer, group=self.group, tag=tag)
            return
        dist.recv(request.tensor, src=peer, group=self.group, tag=tag)
        if self.faults.links:  # the receiver waits out a slow link
            peer_device = self.layout.device_of(self.layout.worker(request.peer))
            request.injected_s = sleep_s(self.faults.transfer_extra_s(peer_device, self.device,
                                                                     nbytes))


class CoordinatedInterpreter(Interpreter):
    """The interpreter of a MegaFBD worker: peers and groups are worker ids,
    and every transfer and program all-reduce goes through the control thread."""

    def __init__(self, worker: int, control: ControlThread, clock: Any, tracer: Any,
                 faults: InjectedFaults, recv_buffer: Callable[[], torch.Tensor],
                 device: torch.device, beacon: Any = None):
        super().__init__(worker, None, clock, tracer, faults, recv_buffer,  # type: ignore[arg-type]
                         coalesce=False, device=device, beacon=beacon)
        self.control = control
        self.watch_completions = False  # requests say when they are done

    def _start(self, handle: Handle) -> None:
        kind = "recv" if handle.is_recv else "send"
        handle.work = self.control.post(kind, (self.rank, handle.peer), handle.tensor,
                                        handle.peer, handle.op.tag)

    def _reduce(self, tensor: torch.Tensor, group: Group,
                op: AllReduce | None = None) -> float | None:
        """MegaFBD's collectives are all-reduces, met by the coordinator."""
        request = self.control.post("allreduce", group, tensor)
        request.wait()
        return request.injected_s

    def _delivered(self, handle: Handle) -> float | None:
        return handle.work.injected_s  # slept by the control thread that received it
