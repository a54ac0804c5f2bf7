"""The torch.distributed interpreter of rank programs (one per process).

Every operation runs for real: Compute calls ``op.run()``; p2p ops map onto
``dist.isend/irecv`` with ``encode_tag(op.tag)``; AllReduce runs
``dist.all_reduce`` on a process group built from the Topology.

NCCL ignores tags and runs a pair's sends and receives in issue order on one
stream, so two ranks that each post a send to the other before their receive
deadlock. With ``coalesce=True`` (the default on NCCL) a send is held back and
posted together with the next receive in one ``dist.batch_isend_irecv`` (what
Megatron's ``send_forward_recv_backward`` does); held sends are posted alone
before any other operation, so a held send never waits on the local compute.

Timing stays off the critical path: each op records two clock marks
(``perf_counter_ns`` on CPU, CUDA events on GPU) and the marks are turned into
events only when the iteration's optimizer step has been issued.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatronapp.ops import (AllReduce, Compute, IRecv, ISend, Op, RankProgram, Recv, Send, Wait,
                             WaitAny, encode_tag)
from megatronapp.topology import Group, Topology
from megatronapp.tracer import Tracer

from .faults import InjectedFaults

POLL_S = 20e-6  # WaitAny polling interval


# ------------------------------------------------------------------ clocks
class HostClock:
    """Monotonic host time in true seconds since ``origin_ns``."""

    def __init__(self, origin_ns: int):
        self.origin_ns = origin_ns

    def mark(self) -> Any:
        return time.perf_counter_ns()

    def now_s(self) -> float:
        return (time.perf_counter_ns() - self.origin_ns) * 1e-9

    def seconds(self, mark: Any) -> float:
        return (mark - self.origin_ns) * 1e-9

    def settle(self) -> None:
        """Nothing to wait for: host marks are final when taken."""

    def work_s(self) -> float:
        """Process CPU seconds: counts compute done, not time spent descheduled
        on a shared CPU (the throttle takes min(CPU, wall) of an op)."""
        return time.process_time()


class CudaClock(HostClock):
    """CUDA events, resolved against one origin event after the iteration."""

    def __init__(self, origin_ns: int, device: torch.device):
        super().__init__(origin_ns)
        self.device = device
        self.origin = torch.cuda.Event(enable_timing=True)
        self.origin.record()
        self.origin_s = self.now_s()

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark: Any) -> float:
        return self.origin_s + self.origin.elapsed_time(mark) * 1e-3

    def settle(self) -> None:
        torch.cuda.synchronize(self.device)

    def work_s(self) -> float:
        self.settle()
        return self.now_s()


# ------------------------------------------------------------------ groups
class GroupCache:
    """Every process group of the topology, created in one order on all ranks."""

    def __init__(self, topo: Topology):
        self._groups: dict[Group, Any] = {}
        every = (topo.tp_groups + topo.dp_groups + topo.pp_groups + topo.model_parallel_groups)
        for group in every:
            if len(group) > 1 and tuple(sorted(group)) not in self._groups:
                self._groups[tuple(sorted(group))] = dist.new_group(sorted(group))

    def get(self, group: Group) -> Any:
        return self._groups[tuple(sorted(group))]


# ----------------------------------------------------------------- handles
@dataclass(eq=False)
class Handle:
    """An outstanding isend/irecv; ``work`` is None while a send is held."""

    op: ISend | IRecv | Send | Recv
    peer: int
    tensor: torch.Tensor
    start: Any
    work: Any = None
    finished: bool = False
    watcher: "Watcher | None" = None

    def completed(self) -> bool:
        if self.watcher is not None:
            return self.watcher.done.is_set()
        return self.work.is_completed()

    def wait(self) -> None:
        if self.watcher is not None:
            self.watcher.join()
        else:
            self.work.wait()

    @property
    def is_recv(self) -> bool:
        return isinstance(self.op, (IRecv, Recv))

    def p2p_op(self) -> dist.P2POp:
        fn = dist.irecv if self.is_recv else dist.isend
        return dist.P2POp(fn, self.tensor, self.peer, tag=encode_tag(self.op.tag))


class Watcher:
    """Waits on one work in a thread: gloo's point-to-point works report
    completion only through ``wait()``, never through ``is_completed()``."""

    def __init__(self, work: Any):
        self.done = threading.Event()
        self.error: BaseException | None = None
        threading.Thread(target=self._run, args=(work,), daemon=True).start()

    def _run(self, work: Any) -> None:
        try:
            work.wait()
        except BaseException as err:  # re-raised in the rank's own thread
            self.error = err
        finally:
            self.done.set()

    def join(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


@dataclass
class Pending:
    name: str
    start: Any
    end: Any
    args: dict[str, Any]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Interpreter:
    """Runs one rank program against torch.distributed."""

    def __init__(self, rank: int, groups: GroupCache, clock: HostClock, tracer: Tracer,
                 faults: InjectedFaults, recv_buffer: Callable[[], torch.Tensor],
                 coalesce: bool = False):
        self.rank, self.groups, self.clock, self.tracer = rank, groups, clock, tracer
        self.faults, self.recv_buffer, self.coalesce = faults, recv_buffer, coalesce
        self._held: list[Handle] = []
        self.watch_completions = dist.get_backend() == "gloo"
        self._pending: list[Pending] = []
        self._handlers: dict[type, Callable[[Any], Any]] = {
            Compute: self._compute, ISend: self._isend, IRecv: self._irecv, Send: self._send,
            Recv: self._recv, Wait: self._wait, WaitAny: self._wait_any,
            AllReduce: self._allreduce}

    def run(self, program: RankProgram) -> None:
        result: Any = None
        while True:
            try:
                op = program.send(result)
            except StopIteration:
                break
            if not isinstance(op, (IRecv, Recv)):
                self._post_held()  # before blocking on anything, or computing
            result = self._handlers[type(op)](op)
        self._post_held()
        self.flush()

    # --------------------------------------------------------------- trace
    def _note(self, name: str, start: Any, end: Any, args: dict[str, Any]) -> None:
        self._pending.append(Pending(name, start, end, args))

    def flush(self) -> None:
        """Resolve buffered marks into tracer events (after an iteration)."""
        self.clock.settle()
        for p in self._pending:
            self.tracer.record(p.name, self.clock.seconds(p.start), self.clock.seconds(p.end),
                               p.args)
        self._pending.clear()

    # ------------------------------------------------------------- compute
    def _compute(self, op: Compute) -> Any:
        start_s, start, work = self.clock.now_s(), self.clock.mark(), self.clock.work_s()
        result = op.run() if op.run is not None else None
        self._throttle(start_s, work)
        self._note(op.name, start, self.clock.mark(), dict(op.meta))
        if op.name == "optimizer":
            self.flush()
        return result

    def _throttle(self, start_s: float, work_start: float) -> None:
        if self.faults.device.windows:
            done = min(self.clock.work_s() - work_start, self.clock.now_s() - start_s)
            time.sleep(max(0.0, self.faults.compute_extra_s(start_s, done)))

    # ----------------------------------------------------------------- p2p
    def _isend(self, op: ISend | Send) -> Handle:
        tensor = op.tensor.contiguous()
        handle = Handle(op, op.dst, tensor, self.clock.mark())  # type: ignore[arg-type]
        if self.coalesce:
            self._held.append(handle)
        else:
            handle.work = dist.isend(tensor, op.dst, tag=encode_tag(op.tag))
        return handle

    def _irecv(self, op: IRecv | Recv) -> Handle:
        like = op.like if isinstance(op.like, torch.Tensor) else self.recv_buffer()
        handle = Handle(op, op.src, torch.empty_like(like), self.clock.mark())  # type: ignore[arg-type]
        if self._held:
            self._held.append(handle)
            self._post_held()
        else:
            handle.work = dist.irecv(handle.tensor, op.src, tag=encode_tag(op.tag))
        return handle

    def _post_held(self) -> None:
        """Post held sends (and a trailing receive) as one batch."""
        if self._held:
            works = dist.batch_isend_irecv([h.p2p_op() for h in self._held])
            for h, work in zip(self._held, works):
                h.work = work
            self._held = []

    def _send(self, op: Send) -> None:
        handle = self._isend(op)
        self._post_held()
        return self._wait(Wait(handle))

    def _recv(self, op: Recv) -> torch.Tensor:
        return self._wait(Wait(self._irecv(op)))

    def _finish(self, handle: Handle) -> torch.Tensor | None:
        if not handle.finished:
            handle.finished = True
            if handle.is_recv:  # a slow link delivers later than the real one did
                time.sleep(self.faults.transfer_extra_s(handle.peer, self.rank,
                                                        _nbytes(handle.tensor)))
            self._note(handle.op.name, handle.start, self.clock.mark(),
                       {**handle.op.meta, "bytes": _nbytes(handle.tensor), "peer": handle.peer})
        return handle.tensor if handle.is_recv else None

    def _wait(self, op: Wait) -> torch.Tensor | None:
        handle: Handle = op.handle
        handle.wait()
        return self._finish(handle)

    def _wait_any(self, op: WaitAny) -> int:
        handles: tuple[Handle, ...] = op.handles
        if self.watch_completions:
            for h in handles:
                if not h.finished and h.watcher is None:
                    h.watcher = Watcher(h.work)
        while True:
            for i, h in enumerate(handles):
                if h.finished or h.completed():
                    h.wait()  # surfaces a failed transfer as an exception
                    self._finish(h)
                    return i
            time.sleep(POLL_S)

    # ---------------------------------------------------------- collective
    def _allreduce(self, op: AllReduce) -> Any:
        tensor = op.tensor if op.tensor is not None else torch.zeros(1)
        group = tuple(sorted(op.group))
        start = self.clock.mark()
        time.sleep(self.faults.allreduce_extra_s(group, _nbytes(tensor)))
        if len(group) > 1:
            dist.all_reduce(tensor, group=self.groups.get(group))
        self._note(op.name, start, self.clock.mark(),
                   {**op.meta, "bytes": _nbytes(tensor), "group": list(op.group)})
        return op.tensor
