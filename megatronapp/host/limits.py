"""What a job will cost, estimated before any work, against what this machine has.

A scenario's size is cheap to compute in closed form (ranks, events, the
collective group members those events list, faults), and the simulator's cost
per event is measured. Every measured constant lives in ``CostModel`` so that
a faster simulator updates one place. A job that cannot fit in memory, on disk
or in ``max_seconds`` is refused with one line saying the estimate and the
limit; ``--no-limits`` (an explicit choice) skips the check.
"""
from __future__ import annotations

import argparse
import math
import os
import resource
import shutil
from dataclasses import dataclass, replace
from functools import reduce
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from ..costs.run_size import RunSize
from ..errors import UserError
from ..io.gate import readable_bytes

if TYPE_CHECKING:  # the schema (pydantic) loads only when a scenario is estimated
    from ..scenario.config import Scenario

DEFAULT_MAX_SECONDS = 3600.0  # an hour of estimated work: beyond it, say so first


@dataclass(frozen=True)
class TraceCost:
    """What a command that reads a trace costs per event."""

    bytes_per_event: float
    seconds_per_event: float
    held_events: float = math.inf  # events held at once (a command that streams: a batch)
    batched: bool = False  # holds one detector batch at a time plus bounded state (``Batching``)


@dataclass(frozen=True)
class CostModel:
    """Costs of ``megatronapp run`` on the simulator, in CPU time and peak RSS,
    measured on this 2-core CPU machine with ``experiments/limits_calibration.py``
    (slopes between runs that differ in microbatches, or in dp): 54-61 us and
    ~900 B per event, 0.7 us and ~9 B per group member, 317 B of disk per event.
    Rounded up here; see docs/limits.md."""

    base_bytes: float = 100e6  # interpreter, numpy, simpy, pydantic
    base_seconds: float = 1.0
    bytes_per_event: float = 1000.0  # Event objects + JSON dicts while writing
    seconds_per_event: float = 60e-6  # simulate, summarise and write one event
    bytes_per_group_entry: float = 12.0  # a collective event lists its group's ranks
    seconds_per_group_entry: float = 1e-6
    disk_bytes_per_event: float = 320.0  # rank file + merged trace
    disk_bytes_per_group_entry: float = 10.0
    bytes_per_fault: float = 6000.0  # YAML, validation, summary and ground truth
    seconds_per_fault: float = 300e-6
    # A compute op scans its rank's throttle windows at each window edge it
    # crosses: about w * (compute ops + w) scans for w windows on a rank.
    seconds_per_throttle_scan: float = 30e-9
    # The compiled engine (static schedules, no MegaFBD), priced from what it
    # will do (``costs.run_size.RunSize``, counted by the backend before it runs):
    # compiling one pipeline's program, simulating the representatives' events,
    # writing the stored rows (in batches of at most ``store.ROW_GROUP``), and
    # per rank its device, clock, links and class. Measured with
    # experiments/scale_table.py on MegaScale's 175B
    # configuration at 1k-98k GPUs
    # (CPU time and peak RSS of a child; slopes between sizes: ~60 us and ~1.3 kB
    # a rank, ~0.25 us a stored row); the estimate stays within 3x either way.
    compiled_base_seconds: float = 1.5  # imports, scenario, summary
    compiled_seconds_per_program_event: float = 15e-6
    compiled_seconds_per_simulated_event: float = 1.5e-6
    compiled_seconds_per_stored_event: float = 0.3e-6
    compiled_seconds_per_rank: float = 50e-6
    compiled_base_bytes: float = 150e6
    compiled_bytes_per_program_event: float = 1000.0
    # The loop's start and end of every event simulated (16 B an event) are held
    # in memory up to ``compiled_times_held_bytes`` (``sim.kernel_run.SPILL_BYTES``);
    # beyond, they live in a mapped temporary file (``sim.spill``, under TMPDIR)
    # whose pages are handed back as the loop goes and after each batch of rows,
    # so what stays is about a page or two a simulated rank. The trace's rows,
    # the summary and MegaDPP's section are taken a batch of whole pipelines at
    # a time (``EventSource.weighted_batches``); the loop's message slots and
    # tables grow with the job (about 4 B an event). ``python -m
    # experiments.scale_table`` measured 0.44 GB at 1,024 GPUs and 0.58 GB at
    # 12,288 (47 M events simulated, nothing reduced; 1.27 GB with every time
    # in memory, 8.59 GB before the batches): docs/journal/2026-12-06-streaming-store.md
    compiled_bytes_per_simulated_event: float = 4.0
    compiled_times_bytes_per_event: float = 16.0
    compiled_times_held_bytes: float = 128 * 2**20
    compiled_spilled_bytes_per_rank: float = 8192.0
    compiled_bytes_per_batch_row: float = 400.0  # one batch of rows being written
    compiled_disk_bytes_per_event: float = 24.0
    bytes_per_rank: float = 3000.0
    topology_bytes_per_rank: float = 400.0  # ``megatronapp topology`` labels and groups
    topology_seconds_per_rank: float = 15e-6
    # The torch backend runs a process per rank (or device): on a CPU, more than
    # a few per core only thrash; below 64 the backend's own checks speak first.
    torch_processes_per_cpu: int = 8
    torch_min_processes: int = 64
    # Commands that read a trace, measured with ``experiments/limits_calibration.py
    # --scan`` (slopes of peak RSS and CPU time between runs of 78 k and 312 k
    # events; 5 k and 20 k for JSON input): MegaScan on a run's trace.parquet
    # keeps columns (259 B, 0.3 us an event; 9.3 GB at 47 M events), the
    # baselines and JSON input an object per event (1.1 kB, 15 us), analyze
    # 3.6 kB and 47 us, align 1.9 kB and 32 us, export-trace 0.3 kB and 6 us,
    # plot 19 kB and 3.5 ms. Rounded up here.
    # MegaScan's model (dependency graph, replay, expected times per rank)
    # on the stores ``python -m experiments.scale_table`` builds (jitter
    # everywhere; ``taskset -c 1 /usr/bin/time megatronapp detect``), with
    # batches of 1.22 M events at both sizes: 8.1 CPU s and 0.80 GB at 1,024
    # GPUs (3.9 M events), 65-69 s and 0.89 GB at 12,288 (47 M). Per event of
    # the largest batch, over the base: 575 B; per event read: 1.4 us.
    # Rounded up here
    detect_columns: TraceCost = TraceCost(600.0, 1.6e-6, batched=True)
    # What the streaming detector keeps between batches: its bounded samples
    # and counts, per value kept (a float in a reservoir, the dicts and
    # objects around it)
    bytes_per_state_value: float = 40.0
    # A symmetric store read by twin replicas: the verdict holds each rank's
    # share of the state (dict entries, scores, waits) and works through it,
    # measured at 12,288-98,304 GPUs (then ``experiments/scale_table.py``):
    # 10 kB and 0.3-0.4 ms a rank of the job
    bytes_per_twin_rank: float = 10e3
    seconds_per_twin_rank: float = 0.35e-3
    detect_events: TraceCost = TraceCost(1500.0, 20e-6)
    analyze: TraceCost = TraceCost(4000.0, 50e-6)
    align: TraceCost = TraceCost(2200.0, 35e-6)
    export: TraceCost = TraceCost(400.0, 7e-6, held_events=1 << 18)  # store.ROW_GROUP rows
    # query: the aligned columns and sync ops, then DuckDB's typed rows (the
    # view spells names, op ids and args out as it is read)
    query: TraceCost = TraceCost(500.0, 5e-6)
    plot: TraceCost = TraceCost(20e3, 5e-3)
    # A sweep's points, each built and validated before any runs: its scenario as
    # a dict (19 kB and 1.8 ms a point of scenarios/sweeps/throttle_severity.yaml)
    sweep_point_bytes: float = 20e3
    sweep_point_seconds: float = 2e-3
    # validate-detector keeps each trial's report (outcomes, alignment) to the end
    trial_report_bytes: float = 2e3
    # a real trial (2-4 torch ranks spawned, a thread each, run and scored): 30.6 s
    # measured here with ``validate-detector --backend torch --trials 3``
    real_trial_seconds: float = 30.0
    # A JSON trace is sized in events from its bytes (ours take ~200 B an
    # event; fewer bytes an event is the safe side); parsing the text takes
    # ~3.2 B of memory a byte (the text, its dicts and lists).
    json_bytes_per_event: float = 150.0
    json_memory_per_byte: float = 4.0
    # Beyond these closed-form sizes a job is not counted (building its cluster
    # or compiling one pipeline's program would itself take minutes); the closed
    # form, an upper bound, refuses it.
    max_counted_pipe_events: float = 2e6
    max_counted_group_entries_per_rank: float = 1e5  # collectives of huge groups
    max_counted_ranks: float = 250_000
    # scope generate: each step is a forward pass over the whole window (no KV
    # cache), 2 FLOPs a parameter a token, priced at 1 GFLOP/s (torch's CPU
    # matmuls on one busy core, rounded down), and a step's record (its top-k,
    # the statistics captured) at 4 kB
    cpu_flops_per_second: float = 1e9
    bytes_per_generated_token: float = 4e3


COSTS = CostModel()


@dataclass(frozen=True)
class Estimate:
    """A job's size and what it will need."""

    ranks: int
    events: int
    group_entries: int
    faults: int
    memory_bytes: float
    disk_bytes: float
    seconds: float
    simulated_events: int = 0  # events simulated, where fewer than ``events`` (symmetry)

    def describe(self) -> str:
        size = [f"{self.ranks:,} ranks"] if self.ranks else []
        size += [f"{self.events:,} trace events"] if self.events else []
        size += [f"{self.simulated_events:,} simulated"] if self.simulated_events else []
        size += [f"{self.faults:,} faults"] if self.faults else []
        need = [f"{readable_bytes(self.memory_bytes)} memory"]
        need += [f"{readable_bytes(self.disk_bytes)} disk"] if self.disk_bytes else []
        head = f"{', '.join(size)}: " if size else ""
        return f"{head}about {', '.join(need)}, {_duration(self.seconds)}"

    def then(self, other: "Estimate") -> "Estimate":
        """This job followed by ``other`` in the same process: times add, the
        memory peak is the larger one."""
        return Estimate(max(self.ranks, other.ranks), self.events + other.events,
                        self.group_entries + other.group_entries, self.faults + other.faults,
                        max(self.memory_bytes, other.memory_bytes),
                        self.disk_bytes + other.disk_bytes, self.seconds + other.seconds,
                        self.simulated_events + other.simulated_events)


@dataclass(frozen=True)
class Limits:
    """What this machine offers a job now."""

    memory_bytes: float
    disk_bytes: float | None  # free space where the result goes (None: not writing)
    max_seconds: float
    max_torch_ranks: int


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:,.3g} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:,.3g} min"
    return f"{seconds / 3600:,.3g} h"


# ---------------------------------------------------------------- sizes
def _per_rank_iteration(s: Scenario) -> tuple[int, int, int]:
    """(events, group entries, compute ops) one rank records in one iteration:
    per task its plan's compute pieces and TP collectives (taskplan), a receive
    and a send between stages (and the receiver's all-gather with scattered
    messages); per iteration the DP gradient reduction (buckets when
    overlapped), the parameter all-gather of a distributed optimizer, the
    embedding and grad-norm all-reduces and the step."""
    from ..costs.per_op import stage_costs
    from ..costs.taskplan import TpCollective, backward_plan, bucket_sizes, forward_plan

    p, c = s.parallel, stage_costs(s)
    tasks = 2 * p.microbatches * p.vpp
    tp, pp, dp = p.tp, p.pp, p.dp_cp
    plans = (forward_plan(c, 0, 0.0, 0.0, tp > 1), backward_plan(c, 0, 0.0, 0.0, tp > 1, []))
    steps = max(len(plan) for plan in plans)
    tp_ops = max(sum(isinstance(st, TpCollective) for st in plan) for plan in plans)
    p2p = (3 if p.scatter_gather_p2p and tp > 1 else 2) if pp > 1 else 0
    buckets = p.vpp * len(bucket_sizes(c.grad_bytes // p.vpp, c.bucket_bytes))
    dp_ops = (2 * buckets + 2) if dp > 1 else 0  # gradient buckets or one reduction, gathers
    events = tasks * (steps + p2p) + 2 + dp_ops + (tp * pp > 1)
    groups = (tasks * tp * (tp_ops + (p2p == 3)) + dp * dp_ops + 2
              + tp * pp * (tp * pp > 1))
    return events, groups, tasks * steps + 1


def estimate_run(s: Scenario, count: Callable[[Scenario], RunSize | None] | None = None
                 ) -> Estimate:
    """What one run of ``s`` will cost: priced from ``count`` (the backend's
    count of what it will run) where it can count, else in closed form. Counting
    compiles one pipeline's program, so a job whose closed form is too big to
    compile is not counted (it is refused as it is)."""
    estimate = _closed_form(s)
    ranks = max(estimate.ranks, 1)
    countable = (estimate.events * s.parallel.pp / ranks <= COSTS.max_counted_pipe_events
                 and estimate.group_entries / ranks <= COSTS.max_counted_group_entries_per_rank
                 and estimate.ranks <= COSTS.max_counted_ranks)
    size = count(s) if count is not None and countable else None
    return _of_size(estimate, size) if size is not None else estimate


def _closed_form(s: Scenario) -> Estimate:
    """A run on the SimPy interpreter: every event of every rank, as objects."""
    from ..scenario.config import device_count, fault_job

    c = COSTS
    ranks = device_count(s)
    events_ri, groups_ri, compute_ri = _per_rank_iteration(s)
    workers = ranks * (2 if s.fbd is not None else 1)  # MegaFBD: forward + backward threads
    events = s.iterations * workers * events_ri
    groups = s.iterations * workers * groups_ri
    job = fault_job(s)
    windows: dict[int, int] = {}
    fault_bytes = 0.0
    for f in s.faults:  # each kind says what it adds (its windows to price, its data)
        cost = f.cost(job)
        fault_bytes += cost.bytes
        for rank, count in cost.windows.items():
            windows[rank] = windows.get(rank, 0) + count
    scans = sum(w * (s.iterations * compute_ri + w) for w in windows.values())
    faults = len(s.faults)
    return Estimate(
        ranks=ranks, events=events, group_entries=groups, faults=faults,
        memory_bytes=(c.base_bytes + events * c.bytes_per_event + fault_bytes
                      + groups * c.bytes_per_group_entry + faults * c.bytes_per_fault),
        disk_bytes=events * c.disk_bytes_per_event + groups * c.disk_bytes_per_group_entry,
        seconds=(c.base_seconds + events * c.seconds_per_event
                 + groups * c.seconds_per_group_entry + faults * c.seconds_per_fault
                 + scans * c.seconds_per_throttle_scan))


def _of_size(estimate: Estimate, size: RunSize) -> Estimate:
    """A run on the compiled engine, priced from its counts: events as columns,
    one program compiled, the representatives simulated, the stored rows
    written a batch at a time, trace.json only for a browser-sized job."""
    from ..trace.chrome import BROWSER_EVENTS
    from ..trace.store import ROW_GROUP

    c = COSTS
    stored = size.stored_events
    browser = size.trace_events * c.disk_bytes_per_event if size.trace_events <= BROWSER_EVENTS \
        else 0.0
    times = size.simulated_events * c.compiled_times_bytes_per_event
    spilled = times > c.compiled_times_held_bytes
    return replace(
        estimate, ranks=size.ranks, events=size.trace_events, simulated_events=size.simulated_events,
        memory_bytes=(c.compiled_base_bytes + size.program_events * c.compiled_bytes_per_program_event
                      + size.simulated_events * c.compiled_bytes_per_simulated_event
                      + (0.0 if spilled else times)
                      + min(stored, ROW_GROUP) * c.compiled_bytes_per_batch_row
                      + size.ranks * (c.bytes_per_rank
                                      + (c.compiled_spilled_bytes_per_rank if spilled else 0.0))
                      + estimate.faults * c.bytes_per_fault),
        disk_bytes=(stored * c.compiled_disk_bytes_per_event + browser
                    + (times if spilled else 0.0)),  # the file, where TMPDIR is this disk
        seconds=(c.compiled_base_seconds
                 + size.program_events * c.compiled_seconds_per_program_event
                 + size.simulated_events * c.compiled_seconds_per_simulated_event
                 + stored * c.compiled_seconds_per_stored_event
                 + size.ranks * c.compiled_seconds_per_rank
                 + estimate.faults * c.seconds_per_fault))


def estimate_runs(scenarios: Iterable[Scenario],
                  count: Callable[[Scenario], RunSize | None] | None = None) -> Estimate:
    """Several simulations, one after the other (schedule and plan comparisons);
    nothing is written, so no disk."""
    return in_sequence([estimate_run(s, count) for s in scenarios])


def in_sequence(runs: list[Estimate]) -> Estimate:
    """Simulations one after the other in one process, nothing written (no disk)."""
    return replace(reduce(Estimate.then, runs), disk_bytes=0.0)


@dataclass(frozen=True)
class Batching:
    """How a stored run is fed to a streaming command: the events of its
    largest batch, and the values its state keeps at most."""

    batch_events: int
    state_values: int
    read_events: int | None = None  # events the command works on (None: every one)
    twin_ranks: int = 0  # ranks whose state a present twin's stands in for at the verdict


def estimate_trace(stored_events: int, text_bytes: int, cost: TraceCost,
                   batching: Batching | None = None) -> Estimate:
    """Reading a trace of ``stored_events`` rows of a run's Parquet store, or
    of ``text_bytes`` of JSON (sized in events at ``json_bytes_per_event``),
    and working on each event at ``cost``; a ``batched`` cost with the
    store's ``batching`` holds one batch and its state, not every event."""
    c = COSTS
    events = stored_events + math.ceil(text_bytes / c.json_bytes_per_event)
    held, state, worked, twins = min(events, cost.held_events), 0.0, events, 0
    if cost.batched and batching is not None:
        held = min(events, batching.batch_events)
        state = min(events, batching.state_values) * c.bytes_per_state_value
        worked = events if batching.read_events is None else batching.read_events
        twins = batching.twin_ranks
    return Estimate(ranks=0, events=events, group_entries=0, faults=0,
                    memory_bytes=(c.base_bytes + held * cost.bytes_per_event + state
                                  + twins * c.bytes_per_twin_rank
                                  + text_bytes * c.json_memory_per_byte),
                    disk_bytes=0.0, seconds=(c.base_seconds + worked * cost.seconds_per_event
                                             + twins * c.seconds_per_twin_rank))


def estimate_points(points: int) -> Estimate:
    """Building and validating ``points`` points of a sweep, before any is built."""
    c = COSTS
    return Estimate(ranks=0, events=0, group_entries=0, faults=0,
                    memory_bytes=c.base_bytes + points * c.sweep_point_bytes, disk_bytes=0.0,
                    seconds=c.base_seconds + points * c.sweep_point_seconds)


def estimate_generation(tokens: int, parameters: float, window: int, runs: int) -> Estimate:
    """Decoding ``tokens`` tokens ``runs`` times (the clean run and each
    perturbed one beside it), each step a forward over ``window`` tokens."""
    c = COSTS
    steps = tokens * runs
    return Estimate(ranks=1, events=0, group_entries=0, faults=0, memory_bytes=c.base_bytes,
                    disk_bytes=steps * c.bytes_per_generated_token,
                    seconds=c.base_seconds + steps * 2 * parameters * window
                    / c.cpu_flops_per_second)


def estimate_topology(world: int) -> Estimate:
    c = COSTS
    return Estimate(ranks=world, events=0, group_entries=3 * world, faults=0,
                    memory_bytes=c.base_bytes + world * c.topology_bytes_per_rank,
                    disk_bytes=0.0, seconds=c.base_seconds + world * c.topology_seconds_per_rank)


# ----------------------------------------------------------- the machine
def _meminfo_available() -> float | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_headroom() -> float | None:
    """cgroup v2 memory.max - memory.current, when this process is capped."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
    except OSError:
        return None
    return None if limit == "max" else float(limit) - float(used)


def _rlimit_headroom() -> float | None:
    """An address-space cap (ulimit -v) minus what this process already maps."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pages = 0
    return float(soft) - pages * resource.getpagesize()


def available_memory() -> float:
    """Bytes this process can still use: the tightest of RAM, cgroup and ulimit."""
    candidates = [m for m in (_meminfo_available(), _cgroup_headroom(), _rlimit_headroom())
                  if m is not None]
    if not candidates:
        pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else 0
        candidates = [float(pages * resource.getpagesize())]
    return max(0.0, min(candidates))


def max_json_text() -> float:
    """The most JSON text (bytes) this machine's memory can parse now."""
    return available_memory() / COSTS.json_memory_per_byte


def free_disk(directory: Path) -> float | None:
    """Free bytes on the filesystem that would hold ``directory``."""
    for candidate in (directory, *directory.parents):
        if candidate.exists():
            try:
                return float(shutil.disk_usage(candidate).free)
            except OSError:
                return None
    return None


def machine_limits(out_dir: Path | None = None,
                   max_seconds: float = DEFAULT_MAX_SECONDS) -> Limits:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return Limits(memory_bytes=available_memory(),
                  disk_bytes=free_disk(out_dir.absolute()) if out_dir is not None else None,
                  max_seconds=max_seconds,
                  max_torch_ranks=max(COSTS.torch_min_processes,
                                      COSTS.torch_processes_per_cpu * (cpus or 1)))


# ---------------------------------------------------------------- checks
OVERRIDE = "pass --no-limits to try anyway"


def check(estimate: Estimate, limits: Limits, what: str = "this run",
          backend: str = "sim", estimated: bool = True) -> None:
    """Raise one line naming the first limit ``estimate`` exceeds. Memory and
    time are checked where the backend's runs follow the model (``estimated``:
    the simulator); a real run is bounded by its processes."""
    if not estimated and estimate.ranks > limits.max_torch_ranks:
        raise UserError(f"limits: {what} needs {estimate.ranks:,} processes on the {backend} "
                        f"backend; this machine takes at most {limits.max_torch_ranks} "
                        f"({OVERRIDE})")
    if estimated and estimate.memory_bytes > limits.memory_bytes:
        raise UserError(f"limits: {what} is too large for this machine's memory: "
                        f"{estimate.describe()}; {readable_bytes(limits.memory_bytes)} available "
                        f"({OVERRIDE})")
    if limits.disk_bytes is not None and estimate.disk_bytes > limits.disk_bytes:
        raise UserError(f"limits: {what} would write about {readable_bytes(estimate.disk_bytes)} "
                        f"but only {readable_bytes(limits.disk_bytes)} is free there ({OVERRIDE})")
    if estimated and estimate.seconds > limits.max_seconds:
        raise UserError(f"limits: {what} would take too long: {estimate.describe()}; the "
                        f"limit is {_duration(limits.max_seconds)} (raise it with "
                        f"--max-seconds, or {OVERRIDE})")


# ------------------------------------------------------ command options
def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0 (no nan, no inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def add_options(parser: argparse.ArgumentParser) -> None:
    """``--no-limits`` and ``--max-seconds`` for a command that runs simulations."""
    parser.add_argument("--no-limits", action="store_true",
                        help="skip the size check against this machine's memory, disk and "
                             "--max-seconds")
    parser.add_argument("--max-seconds", type=positive_seconds, default=DEFAULT_MAX_SECONDS,
                        metavar="S", help="refuse work estimated to take longer than S "
                                          f"seconds (default {DEFAULT_MAX_SECONDS:g})")


def enforce(args: argparse.Namespace, estimate: Estimate, out_dir: Path | None = None,
            what: str = "this run", backend: str = "sim", estimated: bool = True) -> None:
    """Check ``estimate`` unless the command line said ``--no-limits``."""
    if not args.no_limits:
        check(estimate, machine_limits(out_dir, args.max_seconds), what, backend, estimated)


def json_text_cap(args: argparse.Namespace) -> float:
    """The cap on a JSON trace's text for a command: none with ``--no-limits``."""
    return math.inf if args.no_limits else max_json_text()
