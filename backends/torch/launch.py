"""Spawn one process per rank (gloo on CPU, NCCL on GPUs) and gather the run.

Workers stream their events back through a queue as they record them (so the
caller's ``on_record`` sees progress live) and send their full result at the
end. A failing rank raises ``TorchRankFailed``: one line naming the rank, the
exception and where it was raised, the worker's traceback chained as its
cause. A hang never goes silent: a rank that dies, a rank that is stopped
(SIGSTOP) for ``stall_timeout_s``, or a run in which no rank enters a new
operation for ``stall_timeout_s``, stops every rank and raises
``TorchDeadlock`` with one line naming each rank and the operation it is
blocked in (see watchdog.py). Workers die with the launcher and every stop is
bounded (see lifetime.py); an exception or signal that ends the run early
(``megatronapp.io.interrupts.Interrupted``) carries the note ``stopped N ranks``.
"""
from __future__ import annotations

import contextlib
import os
import queue as queue_mod
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.constants import default_pg_timeout

from megatronapp.errors import Recreatable, UserError
from megatronapp.faults import effects_of
from megatronapp.io.outdirs import scratch_folder
from megatronapp.program.layout import topology_of
from megatronapp.scenario.config import Scenario, ScenarioError, fault_job
from megatronapp.trace.summary import stop_record
from sim import clocks_of
from megatronapp.io.progress import Say, quiet
from megatronapp.program.backend import StopRequest
from megatronapp.trace.events import Event, RunResult

from .lifetime import (die_with_parent, ignore_terminal_signals, is_stopped, join_or_stop,
                       stop_processes, terminal_signals_held)
from .stages import TrainOptions
from .stopping import StopSwitch
from .watchdog import (STALL_TIMEOUT_S, Failure, OpBeacon, ProgressWatch, blocked_line,
                       death_line, describe_failure)
from .worker import PIPELINE, Job, ProgramsFor, WorkerResult, quiet_megatron_warnings

POLL_S = 0.5
REPORT_WAIT_S = 5.0  # how long blocked ranks get to say where they are
DEATH_GRACE_S = 1.0  # a peer's failure may be the echo of a rank that died
EXIT_WAIT_S = 5.0  # finished ranks get this long to exit on their own


class TorchRunError(UserError):
    """A rank failed, died or hung: one line, exit status 2 from the CLI."""


class RemoteTraceback(Exception):
    """A worker's formatted traceback, chained as the cause of ``TorchRankFailed``."""

    def __str__(self) -> str:
        return f"\n{self.args[0]}"


class TorchRankFailed(TorchRunError):
    """A rank raised: ``rank 1 failed: AssertionError: ... (megatron/core/utils.py:468)``."""

    def __init__(self, rank: int, failure: Failure):
        super().__init__(f"rank {rank} failed: {failure.line}")
        self.rank, self.failure = rank, failure


class InjectedCrash(Recreatable, Exception):
    """The rank a ``crash`` fault names died as injected: the job stops there."""

    def __init__(self, rank: int):
        super().__init__(f"rank {rank} crashed as injected")
        self.rank = rank


class TorchDeadlock(TorchRunError):
    """Ranks stopped making progress (or one died or was stopped); ``blocked``
    maps rank -> the op it was blocked in."""

    def __init__(self, head: str, blocked: dict[int, str]):
        super().__init__(f"{head}; {blocked_line(blocked)}")
        self.blocked = blocked


STORE_FILE = "rendezvous"  # the file store's name in the run's private folder


def loopback_only() -> None:
    """Every rank of this launcher is on this host: gloo's and NCCL's sockets
    on the loopback device (no host name resolved, nothing reachable from
    another machine), whatever the environment names."""
    os.environ.update(GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")


def file_store(folder: Path) -> dist.FileStore:
    """The job's rendezvous: a file in a folder private to this run, made by
    the launcher before any rank starts (no port to race for, and no TCP
    listener: torch's TCPStore listens on every interface whatever host it is
    given)."""
    store = dist.FileStore(str(folder / STORE_FILE), -1)
    store.set_timeout(default_pg_timeout)
    return store


@contextlib.contextmanager
def one_process_group() -> Iterator[None]:
    """A process group of this process alone (gloo), its rendezvous a file
    store in a private folder: nothing listens."""
    with scratch_folder("megatronapp-rendezvous-") as folder:
        loopback_only()
        dist.init_process_group("gloo", store=file_store(folder), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _spawned(rank: int, s: Scenario, rendezvous: Path, options: TrainOptions, coalesce: bool | None,
             threads: int, out: Any, counters: Any, stall_flag: Any, job: Job,
             programs: ProgramsFor, launcher_pid: int, switch: StopSwitch | None) -> None:
    die_with_parent(launcher_pid)
    ignore_terminal_signals()  # the launcher owns the stop
    quiet_megatron_warnings()
    loopback_only()
    torch.set_num_threads(threads)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    beacon = OpBeacon(counters, rank)
    beacon.answer_when(stall_flag, lambda what: out.put(("blocked", rank, what)))
    try:
        dist.init_process_group(backend, store=file_store(rendezvous), rank=rank, world_size=job.processes(s))
        result = job.run_rank(s, rank, rank, options, coalesce,
                              on_record=lambda r, e: out.put(("event", r, e)),
                              beacon=beacon, programs=programs,
                              on_phase=lambda text: out.put(("phase", rank, text)),
                              **({"stop": switch} if switch is not None else {}))
        out.put(("done", rank, result))
    except BaseException as err:
        out.put(("error", rank, (describe_failure(err), beacon.describe())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _Gatherer:
    """Reads the workers' queue until every rank is done, or fails loudly."""

    def __init__(self, procs: list[Any], out: Any, counters: Any, stall_flag: Any,
                 stall_timeout_s: float, on_record: Callable[[int, Event], None] | None,
                 on_phase: Say = quiet, stop: tuple[StopRequest, StopSwitch] | None = None,
                 crash: int | None = None):
        self.procs, self.out, self.counters, self.stall_flag = procs, out, counters, stall_flag
        self.stop = stop
        self.crash = crash  # the rank an injected crash kills: its events are kept here
        self.events: dict[int, list[Event]] = {r: [] for r in range(len(procs))}
        self.watch, self.on_record = ProgressWatch(stall_timeout_s), on_record
        self.on_phase = on_phase
        self.results: dict[int, WorkerResult] = {}
        self.blocked: dict[int, str] = {}
        self.stopped_since: dict[int, float] = {}  # rank -> when first seen stopped
        self.next_state_check = 0.0

    def run(self) -> list[WorkerResult]:
        while len(self.results) < len(self.procs):
            try:
                self._handle(*self.out.get(timeout=POLL_S))
                self._stop_if_asked()
            except queue_mod.Empty:
                self._check_deaths()  # only once the queue is drained: "done" may be in it
            now = time.monotonic()
            if self.watch.stalled(self.counters[:], now) or self._stopped_too_long(now):
                raise self._stuck()
        return [self.results[r] for r in range(len(self.procs))]

    def _stop_if_asked(self) -> None:
        """Whoever watches the events (``on_record``) may ask the job to stop."""
        if self.stop is not None and self.stop[0].requested:
            self.stop[0].stopped_after = self.stop[1].stop()

    def _stopped_too_long(self, now: float) -> bool:
        """A rank stopped (SIGSTOP) during set-up, before the progress watch is
        armed, must not hang the run either (checked every ``POLL_S``)."""
        if now < self.next_state_check:
            return False
        self.next_state_check = now + POLL_S
        stopped = {r for r, p in enumerate(self.procs) if is_stopped(p.pid)}
        self.stopped_since = {r: self.stopped_since.get(r, now) for r in stopped}
        return any(now - t >= self.watch.timeout_s for t in self.stopped_since.values())

    def _handle(self, kind: str, rank: int, payload: Any) -> None:
        if kind == "error":
            failure, self.blocked[rank] = payload
            self._echo_of_death(rank)
            raise TorchRankFailed(rank, failure) from RemoteTraceback(failure.traceback)
        if kind == "event" and self.crash is not None:
            self.events[rank].append(payload)
        if kind == "event" and self.on_record is not None:
            self.on_record(rank, payload)
        elif kind == "phase":
            self.on_phase(payload)
        elif kind == "done":
            self.results[rank] = payload
        elif kind == "blocked":
            self.blocked[rank] = payload

    def _check_deaths(self, exclude: int | None = None) -> None:
        if self.crash is not None and self.procs[self.crash].exitcode == -signal.SIGKILL:
            self._drain()
            raise InjectedCrash(self.crash)
        for rank, p in enumerate(self.procs):
            if p.exitcode is not None and rank not in self.results and rank != exclude:
                raise self._stuck(death_line(rank, p.exitcode, self.counters[rank]), dead=rank)

    def _drain(self) -> None:
        """Keep the events still queued (what the ranks recorded before the crash)."""
        while True:
            try:
                kind, rank, payload = self.out.get(timeout=POLL_S)
            except queue_mod.Empty:
                return
            if kind == "event":
                self.events[rank].append(payload)

    def _echo_of_death(self, failed: int) -> None:
        """A rank whose peer died fails too (gloo: connection closed): report
        the death, the cause, when some other rank exits without a result."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for r, p in enumerate(self.procs) if r != failed):
                self._check_deaths(exclude=failed)
            time.sleep(0.05)

    def _stuck(self, head: str | None = None, dead: int | None = None) -> TorchDeadlock:
        """Ask every live, unfinished rank where it is blocked (for a while); a
        stopped rank cannot answer and is named first instead. ``head``: what
        ended the run (default: the stall)."""
        self.stall_flag.value = 1
        live = {r for r, p in enumerate(self.procs) if p.exitcode is None and r not in self.results}
        stopped = sorted(r for r in live if is_stopped(self.procs[r].pid))
        head = head or f"no rank made progress for {self.watch.timeout_s:g} s"
        if stopped:
            names = ", ".join(str(r) for r in stopped)
            head = (f"rank{'s' if len(stopped) > 1 else ''} {names} stopped (process state T: "
                    f"SIGSTOP or a debugger); {head}")
        elif dead is None:
            head = f"deadlock: {head}"
        waiting = live - self.blocked.keys() - set(stopped)
        deadline = time.monotonic() + REPORT_WAIT_S
        while not waiting <= self.blocked.keys() and time.monotonic() < deadline:
            waiting = {r for r in waiting if self.procs[r].exitcode is None}  # the dead say nothing
            try:
                kind, rank, payload = self.out.get(timeout=POLL_S)
            except queue_mod.Empty:
                continue
            if kind in ("blocked", "error"):  # a failed rank says where it failed
                self.blocked[rank] = payload if kind == "blocked" else payload[1]
        blocked = {**{r: "? (no answer)" for r in waiting}, **self.blocked}
        return TorchDeadlock(head, {r: w for r, w in blocked.items()
                                    if r != dead and r not in stopped})


def crash_rank(s: Scenario, processes: int) -> int | None:
    """The rank whose process an injected crash kills (a pipeline job's rank)."""
    stop = effects_of(s.faults, fault_job(s)).stop
    return stop[0] if stop is not None and stop[0] < processes else None


def crashed_run(s: Scenario, events: dict[int, list[Event]], rank: int) -> RunResult:
    """The run an injected crash of ``rank`` stopped: every event recorded before."""
    stop = effects_of(s.faults, fault_job(s)).stop
    result = RunResult("torch", topology_of(s), events, clocks_of(s))
    result.stopped = stop_record(result, rank, stop[1] if stop is not None else 0.0)
    return result


def check_gpus(s: Scenario, processes: int) -> None:
    """NCCL needs a GPU of its own for every rank of this host."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and processes > gpus:
        raise ScenarioError("parallel", f"the run needs {processes} ranks but this host has "
                            f"{gpus} GPU(s); NCCL needs one per rank")


def check_megatron(s: Scenario) -> None:
    """What megatron-core asserts inside every rank, said before any is spawned."""
    vocab, tp = s.model.vocab, s.parallel.tp
    if vocab % tp:
        raise ScenarioError("model.vocab", f"{vocab} is not divisible by parallel.tp = {tp} "
                            "(megatron-core splits the vocabulary over the TP ranks)")


def spawn_run(s: Scenario, options: TrainOptions = TrainOptions(), coalesce: bool | None = None,
              on_record: Callable[[int, Event], None] | None = None, *,
              stall_timeout_s: float = STALL_TIMEOUT_S, programs: ProgramsFor | None = None,
              on_phase: Say = quiet, job: Job | None = None, stop: StopRequest | None = None
              ) -> tuple[RunResult, list[WorkerResult]]:
    """Run ``s`` on fresh processes, one per rank of ``job`` (default: the
    pipeline's ``s.world_size`` ranks; ``FBD`` in ``fbd_worker``: a process per
    MegaFBD worker); the RunResult plus each rank's raw result (losses,
    gradient norms, optional step capture). ``programs`` (default the job's;
    a module-level function, since it is pickled) builds the rank programs
    from the scenario and the stages. ``stop``: set ``requested`` (from
    ``on_record``) to stop every rank after the latest iteration one has
    begun; ``stopped_after`` then says which (see stopping.py)."""
    job = job or PIPELINE
    world = job.processes(s)
    check_gpus(s, world)
    check_megatron(s)
    ctx = mp.get_context("spawn")
    out, stall_flag = ctx.Queue(), ctx.RawValue("b", 0)
    counters = ctx.RawArray("q", world)  # ops entered per rank
    threads = max(1, (os.cpu_count() or 1) // world)
    build = programs if programs is not None else job.programs
    switch = StopSwitch(ctx, world) if stop is not None else None
    with scratch_folder("megatronapp-rendezvous-") as rendezvous:
        file_store(rendezvous)  # the file exists before any rank opens it
        procs = [ctx.Process(target=_spawned, args=(r, s, rendezvous, options, coalesce, threads,
                                                    out, counters, stall_flag, job, build,
                                                    os.getpid(), switch))
                 for r in range(world)]
        on_phase(f"spawning {world} ranks")
        stopping = None if stop is None or switch is None else (stop, switch)
        gatherer = _Gatherer(procs, out, counters, stall_flag, stall_timeout_s, on_record,
                             on_phase, stopping, crash_rank(s, world))
        try:
            results = _gather(procs, gatherer)
        except InjectedCrash as crash:  # the job stops: what it recorded is its run
            return crashed_run(s, gatherer.events, crash.rank), []
    return job.assemble(s, results), results


def _gather(procs: list[Any], gatherer: _Gatherer) -> list[WorkerResult]:
    """Start every rank and gather their results; a failure, or Interrupted by a
    signal, stops every rank first."""
    try:
        with terminal_signals_held():
            for p in procs:
                p.start()
        results = gatherer.run()
        join_or_stop(procs, EXIT_WAIT_S)
    except BaseException as err:
        stopped = stop_processes([p for p in procs if p.pid is not None])
        if stopped:
            err.add_note(f"stopped {stopped} rank{'s' if stopped > 1 else ''}")
        raise
    return results
