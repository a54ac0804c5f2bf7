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
In that mode *every* p2p op goes through ``batch_isend_irecv``, a lone one
included: NCCL runs batched p2p on the group's communicator and single
isend/irecv on a separate two-rank one, so a batched send never meets a
single receive. NCCL also returns one work for a whole batch (gloo one per
op); every handle of the batch then shares it.

Timing stays off the critical path: each op records two clock marks
(``perf_counter_ns`` on CPU, pooled CUDA events on GPU). Marks become events
when the iteration's optimizer step has been issued, and on GPU only those
whose end event has already completed (``query()``, no synchronize); the rest
wait for the next iteration or the end of the program. Nothing on the CPU path
syncs, and fault pricing is skipped for a rank without faults.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.profiler import record_function

from megatronapp.parallel.ops import (AllGather, AllReduce, Compute, IRecv, ISend, Op, RankProgram, Recv,
                             ReduceScatter, Send, Wait, WaitAny, encode_tag, trace_args)
from megatronapp.parallel.topology import Group, Topology
from megatronapp.scan.online.live import QUEUED
from megatronapp.trace.events import Tracer
from sim import InjectedFaults

from .watchdog import OpBeacon

POLL_S = 20e-6  # WaitAny polling interval
# torch.profiler's name for an iteration's range; trace readers take the
# earliest such range of a rank and iteration as where its iteration began
STEP = "ProfilerStep#{}"
# Trace arg of an op on a rank with faults: the seconds the fault model added
# (slept inside the op), so a trace says what was injected where.
INJECTED = "injected_s"
# ``QUEUED``: trace arg of a compute op on CPU, the seconds its thread sat
# runnable but not running (a GPU kernel's time excludes them; on CPU
# ``dur - queued_s`` is the op's time on the device).
SCHEDSTAT = "/proc/thread-self/schedstat"  # ns on CPU, ns runnable-waiting, slices


def fail_stop() -> None:
    """Die at once, as a crashed process does: no cleanup, no last word (the
    launcher tells an injected crash by the rank and the signal)."""
    os.kill(os.getpid(), signal.SIGKILL)


def sleep_s(seconds: float) -> float:
    """Sleep ``seconds`` (none if not positive); returns the seconds asked for."""
    seconds = max(0.0, seconds)
    if seconds > 0:
        time.sleep(seconds)
    return seconds


# ------------------------------------------------------------------ clocks
@dataclass(frozen=True)
class Busy:
    """A thread's accounts at a moment: wall, CPU and run-queue seconds."""

    wall_s: float
    work_s: float
    queued_s: float | None


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

    def ready(self, mark: Any) -> bool:
        """Host marks are final when taken."""
        return True

    def release(self, mark: Any) -> None:
        """Nothing to recycle."""

    def settle(self) -> None:
        """Nothing to wait for: host marks are final when taken."""

    def work_s(self) -> float:
        """Process CPU seconds: counts compute done, not time spent descheduled
        on a shared CPU (the throttle takes min(CPU, wall) of an op where the
        run queue is not known)."""
        return time.process_time()

    def queued_s(self) -> float | None:
        """Seconds the calling thread has waited to run so far (Linux
        schedstat; None where the kernel does not say)."""
        try:
            with open(SCHEDSTAT, "rb") as f:
                return int(f.read().split()[1]) * 1e-9
        except (OSError, IndexError, ValueError):
            return None

    def busy(self, work: bool) -> Busy:
        """Where the calling thread's accounts stand now (an op's start);
        ``work``: the work done too (a throttle needs it; on GPU it syncs)."""
        return Busy(self.now_s(), self.work_s() if work else 0.0, self.queued_s())

    def queued_since(self, since: Busy) -> float | None:
        """Seconds the thread waited to run since ``since`` (None: not known)."""
        now = self.queued_s()
        return None if since.queued_s is None or now is None else now - since.queued_s

    def on_device_s(self, since: Busy) -> float:
        """Seconds since ``since`` that the op held its device: wall time less
        the wait to run, else min(CPU, wall); never the time other processes
        had the cores."""
        # the wait first: one that falls between the two reads then counts in
        # neither or in the wall time, never in the wait alone (a negative time)
        queued = self.queued_since(since)
        wall = self.now_s() - since.wall_s
        return wall - queued if queued is not None else min(self.work_s() - since.work_s, wall)


class CudaClock(HostClock):
    """CUDA events on the current stream, resolved against one origin event;
    resolved events are recycled, so steady state allocates none."""

    def __init__(self, origin_ns: int, device: torch.device):
        super().__init__(origin_ns)
        self.device = device
        self._free: list[Any] = []
        self.origin = torch.cuda.Event(enable_timing=True)
        self.origin.record()
        torch.cuda.synchronize(device)  # once: the origin's host time is its GPU time
        self.origin_s = self.now_s()

    def mark(self) -> Any:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark: Any) -> float:
        return self.origin_s + self.origin.elapsed_time(mark) * 1e-3

    def ready(self, mark: Any) -> bool:
        return bool(mark.query())

    def release(self, mark: Any) -> None:
        self._free.append(mark)

    def settle(self) -> None:
        torch.cuda.synchronize(self.device)

    def work_s(self) -> float:
        """Only a throttled rank asks (it must know how long its kernels took)."""
        self.settle()
        return self.now_s()

    def queued_s(self) -> float | None:
        """Kernel times do not include the host's scheduling."""
        return None


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
    injected_s: float | None = None  # a send's: how late a slow link let it leave

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


# how torch.profiler names a program's send call (torch records it as the call runs)
SEND_CALL = "c10d::send"


class LateSend:
    """A send over a slow link, posted by the link's own thread once the
    link's extra time has passed: the data leaves (and arrives) that much
    later, so the receive waiting for it lasts longer, as a profiler sees
    it, while the sender's program goes on. One thread per link keeps its
    messages in order.

    A profile shows it as a slow wire shows a send: the program's send call
    (``SEND_CALL``) on its own thread when it posted the send, and gloo's
    ``gloo:send`` work from when the message leaves. ``post`` must hand the
    send to the process group's backend, below torch's recorded call, so the
    send is recorded once."""

    def __init__(self, post: Callable[[], Any], delay_s: float, link: ThreadPoolExecutor):
        with record_function(SEND_CALL):
            self._posted: Future[Any] = link.submit(_post_at, post, time.monotonic() + delay_s)

    def wait(self) -> None:
        self._posted.result().wait()

    def is_completed(self) -> bool:
        return self._posted.done() and bool(self._posted.result().is_completed())


def _backend_send(handle: Handle) -> Any:
    """``isend`` handed straight to the default group's backend (gloo): torch
    records no send call for it, only gloo's work."""
    backend: Any = dist.distributed_c10d._get_default_group()._get_backend(handle.tensor.device)
    return backend.send([handle.tensor], handle.peer, encode_tag(handle.op.tag))


def _post_at(post: Callable[[], Any], due_s: float) -> Any:
    time.sleep(max(0.0, due_s - time.monotonic()))
    return post()


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


def works_per_op(works: list[Any], ops: int) -> list[Any]:
    """``batch_isend_irecv`` returns one work per op (gloo) or a single work
    for the whole coalesced batch (NCCL): one work for each op either way."""
    if len(works) == ops:
        return list(works)
    if len(works) == 1:
        return list(works) * ops
    raise RuntimeError(f"batch_isend_irecv returned {len(works)} works for {ops} ops")


def _ignore(op: Op) -> None:
    """No watchdog is listening."""


class StepRanges:
    """Each iteration's range on one rank, as torch.profiler's ``ProfilerStep#N``
    marks it: from entering the iteration's first op (before any host time
    that op waits, such as a stalled data loader) to entering the next
    iteration's, the last to the end of the program. Without it a rank's time
    before its first op would belong to no iteration."""

    def __init__(self, clock: HostClock, note: Callable[[str, Any, Any, dict[str, Any]], None]):
        self.clock, self.note = clock, note
        self.iteration: int | None = None
        self.began: Any = None

    def entering(self, op: Op) -> None:
        iteration = getattr(op, "meta", {}).get("iteration")
        if not isinstance(iteration, int) or iteration < 0:
            return  # set-up, or an op of no iteration
        if self.iteration is not None and iteration <= self.iteration:
            return
        self.close()
        self.iteration, self.began = iteration, self.clock.mark()

    def close(self) -> None:
        if self.iteration is not None:
            self.note(STEP.format(self.iteration), self.began, self.clock.mark(),
                      {"iteration": self.iteration, "kind": "other"})
            self.iteration = None


class Interpreter:
    """Runs one rank program against torch.distributed."""

    def __init__(self, rank: int, groups: GroupCache, clock: HostClock, tracer: Tracer,
                 faults: InjectedFaults, recv_buffer: Callable[[], torch.Tensor],
                 coalesce: bool = False, device: torch.device = torch.device("cpu"),
                 beacon: OpBeacon | None = None,
                 on_receive: Callable[[Any, Any, int, torch.Tensor], None] | None = None):
        self.rank, self.groups, self.clock, self.tracer = rank, groups, clock, tracer
        self.faults, self.recv_buffer, self.coalesce = faults, recv_buffer, coalesce
        self._enter = beacon.entered if beacon is not None else _ignore
        self._on_receive = on_receive  # MegaScope: (tag, meta, peer, tensor) of each arrival
        self._held: list[Handle] = []
        self._links: dict[int, ThreadPoolExecutor] = {}  # peer -> its slow link's sender
        self.watch_completions = dist.get_backend() == "gloo"
        self._pending: list[Pending] = []
        self._scratch = torch.zeros(1, device=device)  # for an AllReduce without a tensor
        self._handlers: dict[type, Callable[[Any], Any]] = {
            Compute: self._compute, ISend: self._isend, IRecv: self._irecv, Send: self._send,
            Recv: self._recv, Wait: self._wait, WaitAny: self._wait_any,
            AllReduce: self._allreduce, ReduceScatter: self._allreduce,
            AllGather: self._allreduce}

    def run(self, program: RankProgram) -> None:
        result: Any = None
        steps = StepRanges(self.clock, self._note)
        while True:
            try:
                op = program.send(result)
            except StopIteration:
                break
            self._enter(op)
            steps.entering(op)
            if self.faults.stop_s is not None and self.clock.now_s() >= self.faults.stop_s:
                fail_stop()  # an injected crash: the process dies here, as a crashed one does
            if not isinstance(op, (IRecv, Recv)):
                self._post_held()  # before blocking on anything, or computing
            result = self._handlers[type(op)](op)
        self._post_held()
        steps.close()
        for link in self._links.values():
            link.shutdown()
        self.flush(final=True)

    # --------------------------------------------------------------- trace
    def _note(self, name: str, start: Any, end: Any, args: dict[str, Any]) -> None:
        self._pending.append(Pending(name, start, end, args))

    def flush(self, final: bool = False) -> None:
        """Resolve buffered marks into tracer events, in order: after an
        iteration those already complete (never waiting on the GPU), at the
        end all of them."""
        if final:
            self.clock.settle()
        done = 0
        for p in self._pending:
            if not self.clock.ready(p.end):
                break
            self.tracer.record(p.name, self.clock.seconds(p.start), self.clock.seconds(p.end),
                               p.args)
            self.clock.release(p.start)
            self.clock.release(p.end)
            done += 1
        del self._pending[:done]

    # ------------------------------------------------------------- compute
    def _compute(self, op: Compute) -> Any:
        throttled = self.faults.compute
        sleep_s(self.faults.host_delay_s(op.name, op.meta.get("iteration", -1)))  # host late
        start, since = self.clock.mark(), self.clock.busy(work=throttled)
        measured: dict[str, float] = {}
        if throttled:
            result, measured[INJECTED] = self._throttled(op, since)
        else:
            result = op.run() if op.run is not None else None
        queued = self.clock.queued_since(since)  # before the end: see on_device_s
        end = self.clock.mark()
        if queued is not None:
            measured[QUEUED] = queued
        self._note(op.name, start, end, {**trace_args(op, result=result), **measured})
        if op.name == "optimizer":
            self.flush()
        return result

    def _throttled(self, op: Compute, since: Busy) -> tuple[Any, float]:
        """Run ``op`` and sleep as long as the throttled device would have
        taken longer than the op held it (so the factor holds at any load);
        returns the result and the seconds slept."""
        result = op.run() if op.run is not None else None
        extra = self.faults.compute_extra_s(since.wall_s, self.clock.on_device_s(since),
                                            op.meta.get("iteration", -1))
        return result, sleep_s(extra)

    # ----------------------------------------------------------------- p2p
    def _isend(self, op: ISend | Send) -> Handle:
        handle = Handle(op, op.dst, op.tensor.contiguous(), self.clock.mark())  # type: ignore[arg-type]
        self._start(handle)
        return handle

    def _irecv(self, op: IRecv | Recv) -> Handle:
        # a fresh tensor per receive: the stage keeps it for its backward
        tensor = (torch.empty_like(op.like) if isinstance(op.like, torch.Tensor)
                  else self.recv_buffer())
        handle = Handle(op, op.src, tensor, self.clock.mark())  # type: ignore[arg-type]
        self._start(handle)
        return handle

    def _start(self, handle: Handle) -> None:
        """Post a transfer; when coalescing, a send is held for the next receive."""
        if self.coalesce:
            self._held.append(handle)
            if handle.is_recv:
                self._post_held()
        elif handle.is_recv:
            handle.work = dist.irecv(handle.tensor, handle.peer, tag=encode_tag(handle.op.tag))
        else:
            handle.work = self._post_send(handle)

    def _post_send(self, handle: Handle) -> Any:
        """``isend`` now, or, over a slow link, once the link lets it leave."""
        if self.faults.links:
            handle.injected_s = max(0.0, self.faults.transfer_extra_s(
                self.rank, handle.peer, _nbytes(handle.tensor), self.clock.now_s()))
        if not handle.injected_s:
            return dist.isend(handle.tensor, handle.peer, tag=encode_tag(handle.op.tag))
        if handle.peer not in self._links:
            self._links[handle.peer] = ThreadPoolExecutor(1, f"link-{self.rank}-{handle.peer}")
        return LateSend(lambda: _backend_send(handle), handle.injected_s, self._links[handle.peer])

    def _post_held(self) -> None:
        """Post held sends (and a trailing receive) as one batch."""
        if self._held:
            works = dist.batch_isend_irecv([h.p2p_op() for h in self._held])
            for h, work in zip(self._held, works_per_op(works, len(self._held))):
                h.work = work
            self._held = []

    def _send(self, op: Send) -> torch.Tensor | None:
        handle = self._isend(op)
        self._post_held()
        return self._wait(Wait(handle))

    def _recv(self, op: Recv) -> torch.Tensor | None:
        return self._wait(Wait(self._irecv(op)))

    def _finish(self, handle: Handle) -> torch.Tensor | None:
        if not handle.finished:
            handle.finished = True
            args = trace_args(handle.op, _nbytes(handle.tensor))
            injected = self._delivered(handle) if handle.is_recv else handle.injected_s
            if injected is not None:
                args[INJECTED] = injected
            if handle.is_recv and self._on_receive is not None:
                self._on_receive(handle.op.tag, handle.op.meta, handle.peer, handle.tensor)
            self._note(handle.op.name, handle.start, self.clock.mark(), args)
        return handle.tensor if handle.is_recv else None

    def _delivered(self, handle: Handle) -> float | None:
        """A receive has completed. Where sends are coalesced (NCCL: a
        batch cannot wait for one slow link) a slow link's receiver sleeps
        now what the link adds (returns the seconds injected, None on a rank
        without link faults); elsewhere the sender posted late (``LateSend``)."""
        if not self.faults.links or not self.coalesce:
            return None
        return sleep_s(self.faults.transfer_extra_s(handle.peer, self.rank,
                                                   _nbytes(handle.tensor), self.clock.now_s()))

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
        """AllReduce, ReduceScatter and AllGather, in place on ``op.tensor``."""
        if op.async_op:
            raise NotImplementedError("the torch backend runs collectives blocking")
        tensor = op.tensor if op.tensor is not None else self._scratch
        start = self.clock.mark()
        args = trace_args(op, _nbytes(tensor))
        injected = self._reduce(tensor, tuple(sorted(op.group)), op)
        if injected is not None:
            args[INJECTED] = injected
        self._note(op.name, start, self.clock.mark(), args)
        return op.tensor

    def _reduce(self, tensor: torch.Tensor, group: Group,
                op: AllReduce | None = None) -> float | None:
        """Run ``op`` (an all-reduce by default) over ``group`` in place; a slow
        link delays it first (returns the seconds injected, None on a rank
        without link faults)."""
        if len(group) < 2:
            return None
        injected = None
        if self.faults.links:
            injected = sleep_s(self.faults.allreduce_extra_s(group, _nbytes(tensor),
                                                             self.clock.now_s()))
        run_collective(op or AllReduce(group, 0), tensor, self.groups.get(group),
                       group.index(self.rank), len(group))
        return injected


def run_collective(op: AllReduce, tensor: torch.Tensor, pg: Any, index: int, n: int) -> None:
    """One collective in place on a tensor. A reduce-scatter leaves member i's
    share summed (gloo has no reduce-scatter: it all-reduces, so the other
    shares hold sums too); an all-gather fills every share from its owner."""
    if isinstance(op, AllGather):
        _all_gather_in_place(tensor, pg, index, n)
    elif isinstance(op, ReduceScatter) and dist.get_backend(pg) == "nccl":
        flat = _padded(tensor.reshape(-1), n)
        share = flat.numel() // n
        out = torch.empty(share, dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter_tensor(out, flat, group=pg)
        lo = index * share
        tensor.reshape(-1)[lo:lo + share].copy_(out[:max(0, min(share, tensor.numel() - lo))])
    else:
        dist.all_reduce(tensor, group=pg)


def _padded(flat: torch.Tensor, n: int) -> torch.Tensor:
    extra = -flat.numel() % n
    return torch.cat([flat, flat.new_zeros(extra)]) if extra else flat


def _all_gather_in_place(tensor: torch.Tensor, pg: Any, index: int, n: int) -> None:
    flat = tensor.reshape(-1)
    padded = _padded(flat, n)
    shares = list(padded.chunk(n))
    mine = shares[index].clone()
    dist.all_gather(shares, mine, group=pg)
    if padded is not flat:
        flat.copy_(padded[:flat.numel()])
