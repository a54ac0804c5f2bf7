"""torch.profiler (Kineto) traces -> the per-rank events MegaScan reads.

A job profiled with ``torch.profiler`` writes one JSON file per rank per
profiling cycle, named any way, often gzipped (``folders`` groups a
folder's files into cycles). What this reader takes from them:

- the rank, from the top-level ``distributedInfo`` (``rank``, ``world_size``,
  ``backend``, and ``pg_config``: each process group's name, ranks and
  description; older traces list no groups, and the default group of all
  ``world_size`` ranks is then taken as known); ``pid`` is an OS process id
  (or a string such as ``"Spans"``) and is not the rank; without
  ``distributedInfo`` the rank is the file name's ``rank<N>``;
- on a GPU trace (``gpu``): every kernel, memory copy and set on every CUDA
  stream, kernels as compute named by the job's op that launched them
  (correlation ids), NCCL kernels as communication whatever the version
  recorded of them; memory operations are kept as other GPU work
  (``gpu_time`` counts them);
- on a CPU trace: the top-level ``record_function`` annotations of a thread
  the job annotated (torch's own ranges do not count), else every top-level
  CPU op, communication aside (an op holding a communication call and other
  ops, as FSDP2's autograd functions hold the all-gather's wait, counts by
  its ops);
- iterations: each ``ProfilerStep#N`` range makes N the iteration of every
  event of the rank that starts inside it, on any thread (GPU work: whose
  launch does);
- communication on CPU: gloo's ``c10d::<op>`` calls with the ``gloo:<op>``
  annotation that runs them (the pair spans the call's arrival to its
  completion); the flat-tensor and coalesced variants
  (``c10d::_allgather_base_``, ``_reduce_scatter_base_``: FSDP2's) are read as
  the collective they vary, run by the gloo range of that collective (a
  reduce-scatter by gloo's ``all_reduce``).

Metadata (``M``), instant (``i``/``I``), counter (``C``), flow (``s``/``t``/
``f``), async and object events are skipped on purpose; anything else, or an
event that is not what its phase promises, is a ``TraceError`` naming the
file and the event index.

Files written on one host (the same ``host_name``) share its clock and are
taken as aligned; files from several hosts are aligned like raw per-rank
traces. What a trace leaves out is inferred across the files of one job: a
collective without a recorded group (gloo's; NCCL's in older traces, where
each communicator runs on its own stream) belongs to the smallest of its
rank's process groups whose members present all made as many such calls; point-to-point ops
without recorded peers are paired by whole ranks where one assignment of
each sending rank to one receiving rank fits their counts and order, else
each gets the peer that every matching of sends to receives fitting their
timing and the job's profiler steps gives it (``p2p_infer``; files of one
host share its clock), else stays unpeered. Ops that are the
same work on data-parallel peers are matched by name and occurrence (no
microbatch index is recorded); a group whose members run the same compute
(the ops they all run alike carry nearly all of each one's time) and send
nothing to each other is named as such a peer group (``dp_``).
"""
from __future__ import annotations

import gzip
import math
import os
import re
import zlib
from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from megatronapp.host import limits
from megatronapp.trace.columns import is_int32
from megatronapp.io import gate
from megatronapp.io.text import TextError, load_json_bytes
from megatronapp.trace.events import Event

from megatronapp.scan.errors import TraceError
from megatronapp.scan.ingest.kineto_spans import (P2P_OPS, ROOTED_OPS, STEP_PREFIX,
                                                  TORCH_RANGES, Comm, ProcessGroup, Span,
                                                  is_comm_span, op_of, own_annotation, role_of,
                                                  shape_bytes)
from megatronapp.scan.ingest.folders import (ALL, EACH, FileWindow, chosen_cycles, group_cycles,
                                             missing_ranks)
from megatronapp.scan.ingest.gpu import MEMORY_CATS, SENDRECV, GpuRead, normal_cat, read_gpu
from megatronapp.scan.ingest.p2p_infer import P2POp, forced_pairs, forced_peers
# ranks do the same work when the ops they all run alike carry SAME_WORK_SHARE
# of each one's compute time (a rank's few extra ops leave them peers)
from megatronapp.scan.ingest.range_work import SAME_WORK_SHARE, OpMix, op_mixes, work_names

RankEvents = dict[int, list[Event]]
Intervals = list[tuple[float, float]]

SKIPPED_PHASES = frozenset({"M", "i", "I", "C", "s", "t", "f", "b", "e", "n", "N", "O", "D",
                            "P", "R", "S", "T", "F", "v", "V", "c"})
LOADED_PHASES = frozenset({"X"})
KINETO_SUFFIXES = (".pt.trace.json", ".pt.trace.json.gz")
JSON_SUFFIXES = (".json", ".json.gz")
CPU_CATS = frozenset({"cpu_op", "user_annotation"})
SAME_WORK = "dp"  # the prefix ``stage_peers`` reads as "these ranks do identical work"


@dataclass(frozen=True)
class ProfilerStep:
    """A ``ProfilerStep#N`` range: iteration N of the job on this rank."""

    start_us: float
    end_us: float
    number: int


@dataclass(frozen=True)
class KinetoRank:
    """What one file gives: the rank, its groups, compute spans, communication."""

    source: str
    rank: int
    base_ns: int
    groups: tuple[ProcessGroup, ...]
    compute: tuple[Span, ...]
    comms: tuple[Comm, ...]
    phases: Mapping[str, int] = field(default_factory=dict)  # ph -> events seen
    steps: tuple[ProfilerStep, ...] = ()
    # the job's annotations (by span index): their stretches without an op
    # not yet known as waits; ``load_kineto`` takes out those spent waiting
    # for a peer at a collective
    idle: Mapping[int, Intervals] = field(default_factory=dict)
    # what each of the job's named ranges holds (``range_work``)
    work: Mapping[str, OpMix] = field(default_factory=dict)
    job: Distributed | None = None
    window: tuple[float, float] = (0.0, 0.0)  # first start, last end (µs)
    host: str = ""  # the file's host_name
    gpu: GpuRead | None = None  # the GPU side, on a GPU trace


# ------------------------------------------------------------------ files
def read_json_any(path: Path, max_bytes: float | None = None) -> Any:
    """A UTF-8 JSON file, plain or gzipped; anything else (binary, UTF-16, too
    deep, a broken gzip stream) is a TraceError naming the file. So is more
    JSON text than ``max_bytes`` (by default what this machine's memory can
    parse, ``limits.max_json_text``; ``math.inf``: no cap): a gzip file is
    inflated in chunks and given up past the cap, so a small file that
    inflates to gigabytes is one line, not a MemoryError."""
    cap = limits.max_json_text() if max_bytes is None else max_bytes
    try:
        raw = gate.read_input(path, "", cap, JSON_CAP_NOTE)  # a regular file; gzip inflated
    except gate.InputError as err:
        raise TraceError(str(path), err.reason(path)) \
            from None
    except OSError as err:
        raise TraceError(str(path), f"cannot read: {err.strerror or err}") from None
    try:
        return load_json_bytes(raw, "the file")
    except TextError as err:
        raise TraceError(str(path), str(err).removeprefix("the file is ")) from None


JSON_CAP_NOTE = (f" of JSON text, the most this machine's memory can parse "
                 f"({limits.OVERRIDE})")


def text_size(path: Path) -> int:
    """Bytes of JSON text in ``path`` without reading it: a gzip file states
    its inflated size (modulo 4 GiB) in its last four bytes; the cap in
    ``read_json_any`` holds whatever it states."""
    try:
        with gate.open_checked(path, "") as fh:
            size = os.fstat(fh.fileno()).st_size
            if not path.name.endswith(".gz") or size < 4:
                return size
            fh.seek(-4, 2)
            return int.from_bytes(fh.read(4), "little")
    except gate.InputError as err:
        raise TraceError(str(path), err.reason(path)) \
            from None
    except OSError as err:
        raise TraceError(str(path), f"cannot read: {err.strerror or err}") from None


def is_kineto(data: Any) -> bool:
    return isinstance(data, dict) and ("distributedInfo" in data or (
        "schemaVersion" in data and "traceEvents" in data))


# keys Kineto writes ahead of its events, and our Chrome exports never do
KINETO_HEAD_KEYS = (b'"schemaVersion"', b'"distributedInfo"', b'"deviceProperties"',
                    b'"baseTimeNanoseconds"')
HEAD_BYTES = 1 << 14


def kineto_files(directory: Path) -> list[Path]:
    """The torch.profiler files of a directory, named any way: ``*.json`` and
    ``*.json.gz`` files whose head holds what Kineto writes first (a
    ``*.pt.trace.json(.gz)`` name suffices; a file whose head cannot be read
    is kept, so that reading it says what is wrong)."""
    return sorted(p for p in directory.iterdir() if not p.name.startswith(".")
                  and p.name.endswith(JSON_SUFFIXES) and p.is_file()
                  and (p.name.endswith(KINETO_SUFFIXES) or _kineto_head(p)))


def _kineto_head(path: Path) -> bool:
    try:
        with gate.open_checked(path, "") as raw:
            fh = gzip.GzipFile(fileobj=raw) if path.name.endswith(".gz") else raw
            head = fh.read(HEAD_BYTES)
    except (OSError, EOFError, zlib.error, ValueError):  # a gate refusal too: read to say why
        return True
    return any(key in head for key in KINETO_HEAD_KEYS)


# ---------------------------------------------------------------- parsing
def _finite(raw: Mapping[str, Any], key: str, source: str, index: int) -> float:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TraceError(source, f"{key!r} must be a finite number, got {value!r}", index)
    return float(value)


@dataclass(frozen=True)
class Distributed:
    """What a file says of its job: ``distributedInfo``'s rank, world size,
    backend and process groups (the rank from the file name where it is absent)."""

    rank: int
    world_size: int | None = None
    backend: str = ""
    groups: tuple[ProcessGroup, ...] = ()


def _distributed(data: Mapping[str, Any], source: str) -> Distributed:
    info = data.get("distributedInfo")
    if info is None:
        found = re.search(r"rank[_-]?(\d+)", Path(source).name)
        if found is None:
            raise TraceError(source, "no 'distributedInfo' (rank) and no rank in the file name")
        rank = int(found.group(1))
        if not is_int32(rank):
            raise TraceError(source, f"the rank in the file name ({found.group(1)[:20]}) "
                             "does not fit 32 bits")
        return Distributed(rank)
    if not isinstance(info, dict) or not is_int32(info.get("rank")) or info["rank"] < 0:
        raise TraceError(source, f"'distributedInfo.rank' must be a rank number (32-bit), got "
                         f"{info.get('rank') if isinstance(info, dict) else info!r:.60}")
    world = info.get("world_size")
    if world is not None and (not is_int32(world) or not info["rank"] < world):
        raise TraceError(source, f"'distributedInfo.world_size' must be a number of ranks above "
                         f"the rank ({info['rank']}), got {world!r:.60}")
    return Distributed(int(info["rank"]), world, str(info.get("backend", "")),
                       _groups(info.get("pg_config"), source))


def _groups(config: Any, source: str) -> tuple[ProcessGroup, ...]:
    if config is None:
        return ()
    if isinstance(config, dict):  # keyed by group name, as some versions wrote it
        config = list(config.values())
    if not isinstance(config, list):
        raise TraceError(source, "'distributedInfo.pg_config' must be a list of groups")
    out = []
    for i, pg in enumerate(config):
        ranks = pg.get("ranks") if isinstance(pg, dict) else None
        if not isinstance(ranks, list) or not all(map(is_int32, ranks)):
            raise TraceError(source, f"'distributedInfo.pg_config[{i}].ranks' must be a list of "
                             "ranks (32-bit)")
        out.append(ProcessGroup(tuple(sorted(ranks)), str(pg.get("pg_desc", "")),
                                str(pg.get("pg_name", ""))))
    return tuple(out)


def _span(raw: Mapping[str, Any], index: int, source: str, shift_us: float) -> Span:
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise TraceError(source, f"'name' must be a non-empty string, got {name!r}", index)
    dur = _finite(raw, "dur", source, index)
    if dur < 0:
        raise TraceError(source, f"negative duration {dur}", index)
    args = raw.get("args") or {}
    if not isinstance(args, dict):
        raise TraceError(source, "'args' must be an object", index)
    return Span(index, name, normal_cat(str(raw.get("cat", ""))), (raw.get("pid"), raw.get("tid")),
                _finite(raw, "ts", source, index) + shift_us, dur, args)


def parse_kineto(data: Any, source: str, origin_ns: int | None = None) -> KinetoRank:
    """One Kineto file; times in µs since ``origin_ns`` (default: its own base)."""
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceError(source, "expected a Kineto trace: {\"traceEvents\": [...], ...}")
    job = _distributed(data, source)
    base = data.get("baseTimeNanoseconds", 0)
    if isinstance(base, bool) or not isinstance(base, int):
        raise TraceError(source, f"'baseTimeNanoseconds' must be an integer, got {base!r}")
    shift_us = (base - (base if origin_ns is None else origin_ns)) * 1e-3
    spans, phases = _spans(data["traceEvents"], source, shift_us)
    window = (min((s.start_us for s in spans), default=0.0),
              max((s.end_us for s in spans), default=0.0))
    steps = _profiler_steps(spans)
    host = str(data.get("host_name", ""))
    gpu = read_gpu(spans, _with_world(job), job.rank)
    if gpu is None:
        compute, idle = _compute(spans)
        return KinetoRank(source, job.rank, base, job.groups, tuple(compute),
                          tuple(_gloo_comms(spans, source)), dict(phases), steps, idle,
                          _range_work(spans), job, window, host)
    gloo = _gloo_comms(spans, source) if any(s.name.startswith("gloo:") for s in spans) else []
    step_ranges = tuple(s for s in spans if s.name.startswith(STEP_PREFIX))
    return KinetoRank(source, job.rank, base, _with_world(job), gpu.work + step_ranges,
                      gpu.comms + tuple(gloo), dict(phases), steps, {}, _range_work(spans), job,
                      window, host, gpu)


def _spans(events: list[Any], source: str, shift_us: float) -> tuple[list[Span], Counter[str]]:
    """The file's complete events (the profiler's own window aside), and how
    many events of each phase it held; any other phase is an error."""
    phases: Counter[str] = Counter()
    spans = []
    for index, raw in enumerate(events):
        if not isinstance(raw, dict):
            raise TraceError(source, "not a JSON object", index)
        ph = raw.get("ph")
        phases[str(ph)] += 1
        if ph in SKIPPED_PHASES:
            continue
        if ph not in LOADED_PHASES:
            raise TraceError(source, f"unsupported phase {ph!r}", index)
        span = _span(raw, index, source, shift_us)
        if span.cat != "Trace":  # the profiler's own window, not work
            spans.append(span)
    return spans, phases


def _with_world(job: Distributed) -> tuple[ProcessGroup, ...]:
    """The job's groups and, where its ``pg_config`` does not list it, the
    default group of every rank (older traces list none)."""
    if job.world_size is None or any(len(g.ranks) == job.world_size for g in job.groups):
        return job.groups
    return (*job.groups, ProcessGroup(tuple(range(job.world_size)), "default_pg", "0"))


STEP_NUMBER = re.compile(re.escape(STEP_PREFIX) + r"#(\d{1,9})$")


def _profiler_steps(spans: Iterable[Span]) -> tuple[ProfilerStep, ...]:
    """The rank's ``ProfilerStep#N`` ranges, by start (one per step: the
    profiler opens it on the thread that calls ``step()``)."""
    steps: dict[int, ProfilerStep] = {}
    for s in spans:
        found = STEP_NUMBER.match(s.name)
        if found is not None:
            steps.setdefault(int(found.group(1)), ProfilerStep(s.start_us, s.end_us,
                                                               int(found.group(1))))
    return tuple(sorted(steps.values(), key=lambda p: p.start_us))


def _iteration_of(steps: Sequence[ProfilerStep], starts: Sequence[float],
                  at_us: float) -> int | None:
    """The number of the step whose range holds ``at_us`` (any thread's
    event started inside it belongs to that iteration), else None."""
    i = bisect_right(starts, at_us) - 1
    return steps[i].number if i >= 0 and at_us <= steps[i].end_us else None


# ---------------------------------------------------------------- compute
# gloo runs some collectives as another: FSDP2's reduce-scatter is an all-reduce
GLOO_RUNS_AS = {"reducescatter": "allreduce"}


def _top_level(spans: Iterable[Span]) -> list[Span]:
    """Spans not inside another span of their lane (ProfilerStep ranges aside)."""
    out: list[Span] = []
    lanes: dict[tuple[Any, Any], list[Span]] = defaultdict(list)
    for s in spans:
        if not s.name.startswith(STEP_PREFIX):
            lanes[s.lane].append(s)
    for lane in lanes.values():
        open_end = -math.inf
        for s in sorted(lane, key=lambda s: (s.start_us, -s.dur_us)):
            if s.start_us >= open_end:
                out.append(s)
                open_end = s.end_us
    return out


def _compute(spans: list[Span]) -> tuple[list[Span], dict[int, Intervals]]:
    """A trace without GPU work (``gpu.read_gpu`` reads the others): the CPU
    threads' annotations or top-level ops, communication aside
    (``_holding_comm``); and the job's annotations' idle stretches not yet
    known as waits (``_less_comm_waits``)."""
    cpu = [s for s in spans if s.cat in CPU_CATS]
    split = {s.index for s in _holding_comm(cpu)}
    # a thread the job annotated is measured by its annotations, the
    # units it names (the ops between them would swamp them)
    annotated = {s.lane for s in cpu if own_annotation(s)}
    pool = [s for s in cpu if s.index not in split and (
        s.lane not in annotated or s.cat == "user_annotation" or is_comm_span(s))]
    pool, idle = _less_comm_waits(pool, cpu, split)
    steps = [s for s in spans if s.name.startswith(STEP_PREFIX)]
    return [s for s in _top_level(pool) if not is_comm_span(s)] + steps, idle


# A thread blocked on a communication call resumes within this long of its end;
# an idle stretch that ends so is a wait, one that ends anywhere else (the
# interpreter's own time between ops while a transfer runs) is not.
WAKE_AFTER_COMM_US = 200.0


def _less_comm_waits(pool: list[Span], cpu: list[Span], holders: set[int]
                     ) -> tuple[list[Span], dict[int, Intervals]]:
    """The job's annotations, each shortened by the stretches inside it when
    its thread ran no op, waiting for a communication call of the rank that
    was under way all along and whose end woke it (DDP's ``backward`` ends
    waiting for the last gradient all-reduce, which runs on gloo's own
    thread): that is waiting, not compute; so is the time in an op
    ``holders`` names (one holding a communication call) outside its own
    ops. Time without communication (a sleep, a throttled device) stays, and
    so do the range and its name. Also each annotation's other idle
    stretches (by span index): a thread woken late is told from one that
    worked only by the other ranks (``_less_peer_waits``)."""
    comm = sorted(((s.start_us, s.end_us) for s in cpu if is_comm_span(s)), key=lambda c: c[1])
    if not comm:
        return pool, {}
    ops: dict[tuple[Any, Any], list[tuple[float, float]]] = defaultdict(list)
    for s in cpu:
        if s.cat == "cpu_op" and not is_comm_span(s) and s.index not in holders:
            ops[s.lane].append((s.start_us, s.end_us))
    busy = {lane: _merged(spans) for lane, spans in ops.items()}
    out: list[Span] = []
    idle: dict[int, Intervals] = {}
    for s in pool:
        if own_annotation(s):
            waited, idle[s.index] = _idle_while(s, comm, busy.get(s.lane, []))
            s = replace(s, dur_us=s.dur_us - waited)
        out.append(s)
    return out, idle


def _range_work(spans: list[Span]) -> dict[str, OpMix]:
    """What each CPU range (the job's or torch's, iterations aside) holds."""
    ops: dict[tuple[Any, Any], list[tuple[float, float, str]]] = defaultdict(list)
    for s in spans:
        if s.cat == "cpu_op" and not is_comm_span(s):
            ops[s.lane].append((s.start_us, s.end_us, s.name))
    for lane_ops in ops.values():
        lane_ops.sort(key=lambda o: (o[0], o[0] - o[1]))
    return op_mixes(((s.name, s.lane, s.start_us, s.end_us) for s in spans
                     if s.cat == "user_annotation" and not is_comm_span(s)
                     and not s.name.startswith(STEP_PREFIX)), ops)


def _by_work(ranks: Mapping[int, KinetoRank]) -> dict[int, KinetoRank]:
    """Each rank with its ranges that are other work than most ranks'
    same-named ones renamed (``range_work``), so none is compared with them."""
    renamed = work_names({r: k.work for r, k in ranks.items()})
    return {r: replace(k, compute=tuple(replace(s, name=renamed[r][s.name])
                                        if s.name in renamed.get(r, {}) else s
                                        for s in k.compute))
            for r, k in ranks.items()}


def _idle_while(span: Span, comm: Intervals, busy: Intervals) -> tuple[float, Intervals]:
    """µs of ``span`` outside ``busy`` (merged, sorted) spent waiting for one of
    ``comm`` (sorted by end): an idle stretch inside a communication that ends
    at most ``WAKE_AFTER_COMM_US`` before the stretch does; and its other
    idle stretches."""
    idle = _minus([(span.start_us, span.end_us)], _clipped(busy, span.start_us, span.end_us))
    woken = [_woken(lo, hi, comm) for lo, hi in idle]
    return (sum(hi - lo for (lo, hi), w in zip(idle, woken) if w),
            [stretch for stretch, w in zip(idle, woken) if not w])


def _woken(lo: float, hi: float, comm: Intervals) -> bool:
    """A communication under way from ``lo`` ended in the last moments before ``hi``."""
    first = bisect_left(comm, hi - WAKE_AFTER_COMM_US, key=lambda c: c[1])
    return any(a <= lo for a, b in comm[first:bisect_right(comm, hi, key=lambda c: c[1])])


def _minus(whole: Intervals, cut: Intervals) -> Intervals:
    """``whole`` (one sorted interval list) without ``cut`` (merged, sorted)."""
    out: Intervals = []
    for lo, hi in whole:
        for a, b in cut:
            if b <= lo or a >= hi:
                continue
            if a > lo:
                out.append((lo, a))
            lo = max(lo, b)
        if lo < hi:
            out.append((lo, hi))
    return out


def _merged(spans: Intervals) -> Intervals:
    out: Intervals = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _clipped(merged: Intervals, lo: float, hi: float) -> Intervals:
    out = []
    for a, b in merged[bisect_right(merged, lo, key=lambda interval: interval[1]):]:
        if a >= hi:
            break
        if b > lo:
            out.append((max(a, lo), min(b, hi)))
    return out


def _holding_comm(cpu: list[Span]) -> list[Span]:
    """Ops and torch's own ranges that hold a communication call of their
    thread and other ops besides (FSDP2's hooks and autograd functions hold
    the all-gather and its wait): their ops are the compute, not the whole."""
    by_lane: dict[tuple[Any, Any], list[Span]] = defaultdict(list)
    for s in cpu:
        by_lane[s.lane].append(s)
    out = []
    for lane in by_lane.values():
        comm = sorted(s.start_us for s in lane if is_comm_span(s) and s.cat == "cpu_op")
        ops = sorted(s.start_us for s in lane if s.cat == "cpu_op" and not is_comm_span(s))
        for s in lane:
            own = 1 if s.cat == "cpu_op" else 0  # an op is not inside itself
            if ((s.cat == "cpu_op" or s.name.startswith(TORCH_RANGES)) and not is_comm_span(s)
                    and _count_within(comm, s) and _count_within(ops, s) > own):
                out.append(s)
    return out


def _count_within(starts: Sequence[float], span: Span) -> int:
    """How many of the sorted start times fall inside ``span``."""
    return bisect_right(starts, span.end_us) - bisect_left(starts, span.start_us)


# ---------------------------------------------------------- communication
def _gloo_comms(spans: list[Span], source: str) -> list[Comm]:
    """c10d::<op> calls, each finished by a gloo:<op> range of that op: the
    one its own thread began during the call (torch makes gloo's work inside
    the call), else the next one left. A send handed to gloo later than the
    program called it (a busy or slow link's own thread) is thus still
    finished by its own work."""
    calls = sorted((s for s in spans if s.name.startswith("c10d::")), key=lambda s: s.start_us)
    runs: dict[str, list[Span]] = defaultdict(list)
    for s in sorted((s for s in spans if s.name.startswith("gloo:")), key=lambda s: s.start_us):
        runs[op_of(s.name)].append(s)
    ops = [_run_op(op_of(call.name), runs) for call in calls]
    inside = _runs_inside(calls, ops, runs)
    used = {id(run) for run in inside.values()}
    left = {op: [r for r in queue if id(r) not in used] for op, queue in runs.items()}
    taken: dict[str, int] = defaultdict(int)
    out = []
    for i, (call, run_op) in enumerate(zip(calls, ops)):
        run = inside.get(i)
        queue = left.get(run_op, [])
        while run is None and taken[run_op] < len(queue):
            candidate = queue[taken[run_op]]
            taken[run_op] += 1
            if candidate.end_us >= call.start_us:
                run = candidate
        op = op_of(call.name)
        end = max(call.end_us, run.end_us) if run is not None else call.end_us
        nbytes = shape_bytes(run.args) if run is not None else 0.0
        out.append(Comm(op, call.start_us, end, nbytes, peer=_concrete_peer(call, op),
                        lane=run.lane if run is not None else None))
    return out


def _run_op(op: str, runs: Mapping[str, list[Span]]) -> str:
    return op if op in runs else GLOO_RUNS_AS.get(op, op)


def _runs_inside(calls: Sequence[Span], ops: Sequence[str], runs: Mapping[str, list[Span]]
                 ) -> dict[int, Span]:
    """Call index -> the first run of its op that its own thread began during the call."""
    starts = {op: [r.start_us for r in queue] for op, queue in runs.items()}
    found: dict[int, Span] = {}
    used: set[int] = set()
    for i, (call, op) in enumerate(zip(calls, ops)):
        queue = runs.get(op, [])
        first = bisect_left(starts.get(op, []), call.start_us)
        for run in queue[first:bisect_right(starts.get(op, []), call.end_us)]:
            if run.lane == call.lane and id(run) not in used:
                found[i] = run
                used.add(id(run))
                break
    return found


def _concrete_peer(call: Span, op: str) -> int | None:
    """record_shapes keeps a send/recv's peer (default group) in 'Concrete Inputs'."""
    inputs = call.args.get("Concrete Inputs")
    if op in P2P_OPS and isinstance(inputs, list) and len(inputs) > 2:
        try:
            peer = int(inputs[2])
        except (TypeError, ValueError):
            return None
        return peer if is_int32(peer) else None
    return None


# ------------------------------------------------------------------- jobs
@dataclass(frozen=True)
class KinetoJob:
    """A job's Kineto files, read: events per rank (seconds since the earliest
    file's base time), per file how many events of each phase it held, the
    hosts the files name, the job's world size where a file states it, the
    profiling cycles read (numbered from 1), and per file its GPU activities
    set aside (launched before profiling began) and its NCCL kernels."""

    events: RankEvents
    phases: dict[str, Mapping[str, int]]
    hosts: frozenset[str]
    world_size: int | None = None
    cycles: tuple[int, ...] = (1,)
    set_aside: Mapping[str, int] = field(default_factory=dict)
    nccl_kernels: Mapping[str, int] = field(default_factory=dict)

    @property
    def one_clock(self) -> bool:
        """Files of one host share its clock: nothing to align."""
        return len(self.hosts) == 1 and "" not in self.hosts

    @property
    def missing_ranks(self) -> list[int]:
        return missing_ranks(self.world_size, self.events)


def load_kineto(paths: Iterable[Path], max_bytes: float | None = None,
                by_work: bool = True, cycle: int | str = ALL) -> KinetoJob:
    """One job of the files: their profiling cycles merged (``cycle`` ``all``)
    or one of them (a number from 1). ``by_work``: ranges that hold other
    work than most ranks' same-named ones are renamed (``range_work``); off
    for a reader that matches the job's own range names to its program
    (``calibrate``)."""
    if cycle == EACH:
        raise ValueError("load_kineto reads one job; kineto_cycles reads each cycle")
    (job,) = kineto_cycles(paths, max_bytes, by_work, cycle)
    return job


def kineto_cycles(paths: Iterable[Path], max_bytes: float | None = None, by_work: bool = True,
                  cycle: int | str = EACH) -> list[KinetoJob]:
    """The files' profiling cycles (``folders.group_cycles``) as jobs: each
    on its own (``each``), merged (``all``) or the one numbered ``cycle``."""
    paths = list(paths)
    datas = [(path, read_json_any(path, max_bytes)) for path in paths]
    bases = [d.get("baseTimeNanoseconds", 0) for _, d in datas if isinstance(d, dict)]
    origin = min((b for b in bases if isinstance(b, int) and not isinstance(b, bool)), default=0)
    parsed = [parse_kineto(data, str(path), origin) for path, data in datas]
    cycles = group_cycles([FileWindow(k.source, k.rank, *k.window) for k in parsed])
    where = str(paths[0].parent) if paths else "<none>"
    return [_cycles_as_one([_cycle_job([parsed[i] for i in cycles[c]], by_work, c + 1) for c in chosen])
            for chosen in chosen_cycles(len(cycles), cycle, where)]


def _cycle_job(files: Sequence[KinetoRank], by_work: bool, number: int) -> KinetoJob:
    """One profiling cycle's files (one per rank) as a job."""
    ranks = {k.rank: k for k in files}
    if by_work:
        ranks = _by_work(ranks)
    comms = _resolve(ranks)
    waiting = _waits_for_peers(comms)
    worlds = [k.job.world_size for k in files if k.job is not None and k.job.world_size]
    return KinetoJob({r: _rank_events(_less_peer_waits(ranks[r], waiting.get(r, [])), comms[r])
                      for r in sorted(ranks)},
                     {k.source: k.phases for k in files}, frozenset(k.host for k in files),
                     max(worlds, default=None), (number,),
                     {k.source: k.gpu.set_aside for k in files if k.gpu is not None},
                     {k.source: k.gpu.nccl_kernels for k in files if k.gpu is not None})


def _cycles_as_one(jobs: Sequence[KinetoJob]) -> KinetoJob:
    """Cycles read as one job: each rank's events of every cycle, in time order."""
    if len(jobs) == 1:
        return jobs[0]
    events: RankEvents = defaultdict(list)
    for job in jobs:
        for r, evs in job.events.items():
            events[r] += evs
    for evs in events.values():
        evs.sort(key=lambda e: (e.start_s, -e.dur_s))
    worlds = [j.world_size for j in jobs if j.world_size is not None]
    return KinetoJob(dict(sorted(events.items())),
                     {src: ph for j in jobs for src, ph in j.phases.items()},
                     frozenset().union(*(j.hosts for j in jobs)), max(worlds, default=None),
                     tuple(c for j in jobs for c in j.cycles),
                     {src: n for j in jobs for src, n in j.set_aside.items()},
                     {src: n for j in jobs for src, n in j.nccl_kernels.items()})


def _waits_for_peers(comms: Mapping[int, list[Comm]]) -> dict[int, Intervals]:
    """Per rank, the time from its call of each collective to the last call
    of that collective among its group (merged): it waited for a peer then,
    however late its thread woke after. The n-th call of a group on each
    member is one collective; a group whose members recorded different
    numbers of calls is left out."""
    starts: dict[tuple[int, ...], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r, cs in comms.items():
        for c in cs:
            if c.group is not None and c.op not in P2P_OPS:
                starts[c.group][r].append(c.start_us)
    out: dict[int, Intervals] = defaultdict(list)
    for group, by_rank in starts.items():
        if set(by_rank) != set(group) or len({len(s) for s in by_rank.values()}) != 1:
            continue
        for arrivals in zip(*(sorted(s) for s in by_rank.values())):
            last = max(arrivals)
            for r, at in zip(by_rank, arrivals):
                if at < last:
                    out[r].append((at, last))
    return {r: _merged(v) for r, v in out.items()}


def _less_peer_waits(k: KinetoRank, waiting: Intervals) -> KinetoRank:
    """``k`` with each annotation shortened by its idle stretches' time in
    ``waiting`` (merged, sorted): waits for a peer, not compute. The last
    to arrive waited for no one, so its own time (a sleep, a throttled
    device) always stays."""
    if not waiting or not k.idle:
        return k
    return replace(k, compute=tuple(
        replace(s, dur_us=s.dur_us - sum(b - a for lo, hi in k.idle[s.index]
                                         for a, b in _clipped(waiting, lo, hi)))
        if s.index in k.idle else s for s in k.compute))


def _resolve(ranks: Mapping[int, KinetoRank]) -> dict[int, list[Comm]]:
    comms = {r: [_with_role(c, k) for c in k.comms] for r, k in ranks.items()}
    comms = _infer_groups(comms, ranks)
    comms = _pair_p2p(comms, ranks)
    return _name_peer_groups(comms, ranks)


def _with_role(c: Comm, k: KinetoRank) -> Comm:
    if c.group is None or c.role:
        return c
    return replace(c, role=next((role_of(g.desc) for g in k.groups if g.ranks == c.group), ""))


def _fitting_group(c: Comm, r: int, ranks: Mapping[int, KinetoRank],
                   by_op: Mapping[tuple[int, str], list[Comm]]) -> ProcessGroup | None:
    """The process group of ``r`` whose every other member made a call of the
    same op overlapping ``c`` (nobody leaves before the last arrives); among
    several, the one whose calls end closest together. Of a group some of
    whose ranks the folder lacks, the members present are asked (two at least)."""
    fits = []
    for g in ranks[r].groups:
        present = [m for m in g.ranks if m in ranks]
        if len(present) < 2 or r not in g.ranks:
            continue
        ends = [c.end_us]
        for m in present:
            if m == r:
                continue
            overlapping = [x.end_us for x in by_op.get((m, c.op), ())
                           if x.start_us <= c.end_us and x.end_us >= c.start_us]
            if not overlapping:
                break
            ends.append(min(overlapping, key=lambda e: abs(e - c.end_us)))
        else:
            fits.append((max(ends) - min(ends), len(g.ranks), g))
    return min(fits, key=lambda f: f[:2])[2] if fits else None


def _infer_groups(comms: dict[int, list[Comm]], ranks: Mapping[int, KinetoRank]
                  ) -> dict[int, list[Comm]]:
    """Groups for collectives recorded without them (gloo). Gloo runs each
    process group on threads of its own, so all calls run by one thread share
    a group: the one most of them fit in time (``_fitting_group``), if more
    than half do. Calls of a one-rank group (Megatron's tensor-parallel
    group at tp 1) fit nothing but may overlap a slow peer's long wait by
    chance, so where a member has more calls in a group than another, its
    least supported threads give the group up (``_trim_surplus``); a group
    whose members still differ in calls, or whose n-th calls mostly do not
    meet, is dropped (its calls could not be matched one to one)."""
    by_op: dict[tuple[int, str], list[Comm]] = defaultdict(list)
    for r, cs in comms.items():
        for c in cs:
            if c.op not in P2P_OPS:
                by_op[(r, c.op)].append(c)
    votes: dict[LaneKey, Counter[ProcessGroup | None]] = defaultdict(Counter)
    for r, cs in comms.items():
        for c in cs:
            if c.op not in P2P_OPS and c.op not in ROOTED_OPS and c.group is None:
                votes[(r, c.op, c.lane)][_fitting_group(c, r, ranks, by_op)] += 1
    chosen: dict[LaneKey, tuple[ProcessGroup, float]] = {}
    for key, counter in votes.items():
        group, n = counter.most_common(1)[0]
        if group is not None and 2 * n > sum(counter.values()):
            chosen[key] = (group, n / sum(counter.values()))
    chosen = _trim_surplus(chosen, {k: sum(v.values()) for k, v in votes.items()},
                           _recorded_calls(comms), set(ranks))
    chosen.update(_rooted_groups(comms, ranks))
    out = {r: [replace(c, group=chosen[(r, c.op, c.lane)][0].ranks,
                       role=role_of(chosen[(r, c.op, c.lane)][0].desc))
               if c.group is None and (r, c.op, c.lane) in chosen else c for c in cs]
           for r, cs in comms.items()}
    return _drop_unmatched_groups(out, set(ranks))


LaneKey = tuple[int, str, Any]  # (rank, op, the thread that ran its calls)


def _rooted_groups(comms: Mapping[int, list[Comm]], ranks: Mapping[int, KinetoRank]
                   ) -> dict[LaneKey, tuple[ProcessGroup, float]]:
    """Groups for rooted collectives recorded without them (``ROOTED_OPS``),
    whose calls need not overlap: by count, as every member of a group calls
    a collective on it as often. A rank's calls of such an op go to its one
    group (2+ members present) whose present members made as many calls of
    it; none where no group or more than one does."""
    count: Counter[tuple[int, str]] = Counter(
        (r, c.op) for r, cs in comms.items() for c in cs
        if c.op in ROOTED_OPS and c.group is None)
    out: dict[LaneKey, tuple[ProcessGroup, float]] = {}
    for r, cs in comms.items():
        for op, lane in dict.fromkeys((c.op, c.lane) for c in cs
                                      if c.op in ROOTED_OPS and c.group is None):
            fits = [g for g in ranks[r].groups if r in g.ranks
                    and sum(m in ranks for m in g.ranks) >= 2
                    and all(count[(m, op)] == count[(r, op)] for m in g.ranks if m in ranks)]
            if len(fits) == 1:
                out[(r, op, lane)] = (fits[0], 1.0)
    return out


def _recorded_calls(comms: Mapping[int, list[Comm]]) -> Counter[tuple[tuple[int, ...], str, int]]:
    """(group, op, rank) -> calls whose group the trace recorded."""
    return Counter((c.group, c.op, r) for r, cs in comms.items() for c in cs
                   if c.group is not None)


def _trim_surplus(chosen: Mapping[LaneKey, tuple[ProcessGroup, float]],
                  calls: Mapping[LaneKey, int],
                  recorded: Mapping[tuple[tuple[int, ...], str, int], int], present: set[int]
                  ) -> dict[LaneKey, tuple[ProcessGroup, float]]:
    """Every member of a group makes as many calls in it: a member with more
    drops its threads from the group, least supported first (``chosen``
    holds each thread's group and the share of its calls that fit it), as
    long as it keeps at least as many calls as the member with fewest (of
    the members ``present`` in the folder)."""
    lanes: dict[tuple[tuple[int, ...], str], dict[int, list[LaneKey]]] = defaultdict(
        lambda: defaultdict(list))
    for key, (group, _) in chosen.items():
        lanes[(group.ranks, key[1])][key[0]].append(key)
    kept = dict(chosen)
    for (members, op), per_rank in lanes.items():
        count = {m: recorded.get((members, op, m), 0) + sum(calls[k] for k in per_rank.get(m, ()))
                 for m in members if m in present}
        fewest = min(count.values())
        for m, keys in per_rank.items():
            for key in sorted(keys, key=lambda k: (chosen[k][1], -calls[k])):
                if count[m] - calls[key] < fewest:
                    break
                count[m] -= calls[key]
                del kept[key]
    return kept


def _drop_unmatched_groups(comms: dict[int, list[Comm]], present: set[int]
                           ) -> dict[int, list[Comm]]:
    """Groups whose present members' calls do not meet in order are not known."""
    calls: dict[tuple[tuple[int, ...], str], dict[int, list[Comm]]] = defaultdict(
        lambda: defaultdict(list))
    for r, cs in comms.items():
        for c in cs:
            if c.group is not None:
                calls[(c.group, c.op)][r].append(c)
    unmatched = {key for key, per_rank in calls.items() if not _meet_in_order(
        [sorted(per_rank.get(m, []), key=lambda c: c.start_us) for m in key[0] if m in present],
        rooted=key[1] in ROOTED_OPS)}
    return {r: [replace(c, group=None, role="") if (c.group, c.op) in unmatched else c
                for c in cs] for r, cs in comms.items()}


def _meet_in_order(sequences: list[list[Comm]], rooted: bool = False) -> bool:
    """Members' calls of one group pair up in order: as many on each, and the
    n-th calls of all members overlap (the last arrives before any leaves)
    for most n; of a rooted collective, the first arrives before any leaves
    (no one can finish before the root has come)."""
    if len({len(s) for s in sequences}) != 1:
        return False
    arrival = min if rooted else max
    meeting = sum(arrival(c.start_us for c in nth) <= min(c.end_us for c in nth)
                  for nth in zip(*sequences))
    return 2 * meeting > len(sequences[0])


def _pair_p2p(comms: dict[int, list[Comm]], ranks: Mapping[int, KinetoRank]
              ) -> dict[int, list[Comm]]:
    """Peers for point-to-point ops the trace did not record: by whole ranks
    where that fits one way only, else op by op where every matching of
    sends to receives that fits their timing and the job's profiler steps
    gives the same one (``p2p_infer``); otherwise they stay unpeered."""
    unpeered = {op: [(r, i) for r, cs in comms.items() for i, c in enumerate(cs)
                     if c.op == op and c.peer is None] for op in P2P_OPS}
    if not unpeered["send"]:
        return comms
    whole = _pair_whole_ranks(comms, unpeered)
    if whole is not None:
        return whole
    found = forced_peers(*(_p2p_ops(unpeered[op], comms, ranks) for op in P2P_OPS))
    out = {r: list(cs) for r, cs in comms.items()}
    for op, peers in zip(P2P_OPS, found):
        for (r, i), peer in zip(unpeered[op], peers):
            if peer is not None:
                out[r][i] = replace(comms[r][i], peer=peer)
    return out


MAX_INFERRED_P2P_RANKS = 64  # pairing whole ranks compares every rank pair


def _fits(sends: list[Comm], recvs: list[Comm]) -> bool:
    """One rank's sends can be another's receives, in order: as many, and
    each receive ends after its send starts."""
    return len(sends) == len(recvs) and all(
        recv.end_us >= send.start_us for send, recv in zip(sends, recvs))


def _pair_whole_ranks(comms: dict[int, list[Comm]], unpeered: Mapping[str, list[tuple[int, int]]]
                      ) -> dict[int, list[Comm]] | None:
    """Every rank's unpeered sends to one receiver, where only one
    sender-to-receiver assignment of whole ranks fits (``forced_pairs``);
    None where none or several do."""
    sends: dict[int, list[int]] = defaultdict(list)
    recvs: dict[int, list[int]] = defaultdict(list)
    for side, op in ((sends, "send"), (recvs, "recv")):
        for r, i in unpeered[op]:
            side[r].append(i)
    if len(sends) + len(recvs) > 2 * MAX_INFERRED_P2P_RANKS:
        return None
    fitting = [(r, s) for r in sends for s in recvs if r != s and _fits(
        [comms[r][i] for i in sends[r]], [comms[s][j] for j in recvs[s]])]
    chosen = forced_pairs(fitting)
    if chosen is None or set(chosen) != set(sends) or set(chosen.values()) != set(recvs):
        return None
    out = {r: list(cs) for r, cs in comms.items()}
    for r, s in chosen.items():
        for i, j in zip(sends[r], recvs[s]):
            out[r][i] = replace(comms[r][i], peer=s)
            out[s][j] = replace(comms[s][j], peer=r)
    return out


def _p2p_ops(where: list[tuple[int, int]], comms: Mapping[int, list[Comm]],
             ranks: Mapping[int, KinetoRank]) -> list[P2POp]:
    """The ops at ``where`` ((rank, index) pairs), with their profiler step."""
    starts = {r: [p.start_us for p in k.steps] for r, k in ranks.items()}
    return [P2POp(r, comms[r][i].start_us, comms[r][i].end_us,
                  _iteration_of(ranks[r].steps, starts[r], comms[r][i].start_us),
                  comms[r][i].lane)
            for r, i in where]


def _name_peer_groups(comms: dict[int, list[Comm]], ranks: Mapping[int, KinetoRank]
                      ) -> dict[int, list[Comm]]:
    """A group with no role whose members run the same compute (``_alike``)
    and exchange no point-to-point messages is a group of peers doing
    identical work."""
    talks = {frozenset((r, c.peer)) for r, cs in comms.items() for c in cs if c.peer is not None}

    def same_work(group: tuple[int, ...]) -> bool:
        return (all(m in ranks for m in group) and _alike([ranks[m] for m in group])
                and not any(frozenset((a, b)) in talks for a in group for b in group if a < b))

    return {r: [replace(c, role=SAME_WORK) if c.group and not c.role and same_work(c.group) else c
                for c in cs] for r, cs in comms.items()}


def _alike(members: Sequence[KinetoRank]) -> bool:
    """The ops every member runs as often as the others carry
    ``SAME_WORK_SHARE`` of each member's compute time (profiler steps, whole
    iterations, aside)."""
    ops = [[s for s in k.compute if not s.name.startswith(STEP_PREFIX)] for k in members]
    counts = [Counter(s.name for s in mine) for mine in ops]
    shared = {n for n, c in counts[0].items() if all(other[n] == c for other in counts[1:])}
    return all(sum(s.dur_us for s in mine if s.name in shared)
               >= SAME_WORK_SHARE * sum(s.dur_us for s in mine) for mine in ops)


def _rank_events(k: KinetoRank, comms: list[Comm]) -> list[Event]:
    """The rank's events; GPU work keeps its stream (``gpu_time`` reads it)
    and the iteration its launch fell in."""
    starts = [p.start_us for p in k.steps]

    def iteration(at_us: float) -> dict[str, int]:
        number = _iteration_of(k.steps, starts, at_us)
        return {} if number is None else {"iteration": number}

    # the kind is recorded as our backends record it (megatronapp.trace.kinds reads it back)
    events = [Event(s.name, s.start_us * 1e-6, s.dur_us * 1e-6,
                    {"cat": s.cat, "kind": _work_kind(s), **_gpu_args(s.args),
                     **iteration(s.args.get("launched_us", s.start_us))})
              for s in k.compute]
    for c in comms:
        args: dict[str, Any] = {"bytes": c.nbytes, "cat": "comm", **iteration(
            c.start_us if c.launched_us is None else c.launched_us)}
        if c.stream is not None:  # an NCCL kernel: communication, whatever is known of it
            args.update(cat="kernel", stream=c.stream,
                        kind="p2p" if c.op in (*P2P_OPS, SENDRECV) else "collective")
        if c.op in P2P_OPS and c.peer is not None:
            args.update(kind="p2p", peer=c.peer)
        elif c.group is not None:
            args.update(kind="collective", group=list(c.group))
        name = f"{c.role}_{c.op}" if c.role else c.op
        events.append(Event(name, c.start_us * 1e-6, (c.end_us - c.start_us) * 1e-6, args))
    events.sort(key=lambda e: (e.start_s, -e.dur_s))
    return events


def _work_kind(s: Span) -> str:
    """Kernels are compute; profiler steps and memory copies and sets are not."""
    return "other" if s.name.startswith(STEP_PREFIX) or s.cat in MEMORY_CATS else "compute"


def _gpu_args(args: Mapping[str, Any]) -> dict[str, Any]:
    return {k: args[k] for k in ("stream", "kernel") if k in args}
