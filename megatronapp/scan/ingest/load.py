"""Trace loading: our run directories and foreign Chrome traces.

A foreign trace (e.g. from a real Megatron run) may use complete (``X``),
begin/end (``B``/``E``) or instant (``i``/``I``) events, as a bare list or as
``{"traceEvents": [...]}``, in any order, with one process (``pid``) per rank.
Anything we cannot read raises ``TraceError`` naming the file and the event,
so a malformed trace never turns into a silently wrong answer.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping

from megatronapp.trace.columns import is_int32
from megatronapp.io import gate
from megatronapp.io.progress import Say, quiet
from megatronapp.io.text import MAX_DEPTH, structure_size
from megatronapp.trace.events import Event

from megatronapp.scan.errors import TraceError
from megatronapp.scan.ingest.folders import ALL, EACH, missing_line, missing_ranks
from megatronapp.scan.ingest.kineto import (KinetoJob, is_kineto, kineto_cycles, kineto_files,
                                            read_json_any, text_size)

RankEvents = dict[int, list[Event]]
__all__ = ["LoadedTrace", "RankEvents", "TraceError", "TraceFiles", "TraceSize", "load_trace",
           "load_traces", "locate_trace", "trace_size"]


@dataclass(frozen=True)
class LoadedTrace:
    """Events per rank in seconds, whether their clocks are aligned yet, and
    (torch.profiler folders) the job's world size and the profiling cycles read."""

    events: Mapping[int, list[Event]]  # a dict, or a stored run's lazy view
    aligned: bool
    source: str
    run_dir: Path | None = None
    world_size: int | None = None
    cycles: tuple[int, ...] = ()  # numbered from 1; () where the trace has none

    @property
    def missing_ranks(self) -> list[int]:
        """Ranks of the job the trace holds no events of."""
        return missing_ranks(self.world_size, self.events)

    def warning(self) -> str | None:
        """The one line to print about missing ranks, if any."""
        missing = self.missing_ranks
        if not missing or self.world_size is None:
            return None
        return missing_line(self.source, self.world_size, sorted(self.events), missing)


# Arguments our analyses read, and what each must hold when present.
INT_ARGS = ("iteration", "microbatch", "chunk", "peer")
ANALYSED_ARGS = (*INT_ARGS, "group", "bytes")


def _number(raw: Mapping[str, Any], key: str, source: str, index: int) -> float:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceError(source, f"{key!r} must be a number, got {_short(value)}", index)
    if not math.isfinite(value):
        raise TraceError(source, f"{key!r} must be a finite number, got {value!r}", index)
    return float(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _rank_of(raw: Mapping[str, Any], source: str, index: int) -> int:
    pid = raw.get("pid")
    if isinstance(pid, float) and pid.is_integer():
        pid = int(pid)
    elif isinstance(pid, str) and pid.strip().lstrip("-").isdigit():
        pid = int(pid)
    if not is_int32(pid):
        raise TraceError(source, f"'pid' must be an integer rank (32-bit), got {_short(pid)}",
                         index)
    return pid


def _raw_events(data: Any, source: str) -> list[Any]:
    raw = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(raw, list):
        raise TraceError(source, "expected a list of events or {\"traceEvents\": [...]}")
    return raw


def events_from_chrome(data: Any, source: str = "<trace>") -> RankEvents:
    """Parse Chrome trace JSON (already decoded) into events per rank, sorted by start."""
    events: RankEvents = defaultdict(list)
    lanes: dict[tuple[int, Any], list[tuple[float, bool, int, Mapping[str, Any]]]] = (
        defaultdict(list))
    for index, raw in enumerate(_raw_events(data, source)):
        if not isinstance(raw, dict):
            raise TraceError(source, "not a JSON object", index)
        ph = raw.get("ph")
        if not isinstance(ph, str):
            raise TraceError(source, f"'ph' (the event's phase) must be a string, got "
                             f"{_short(ph)}", index)
        if ph in ("M", "C", "s", "t", "f", "b", "e", "n"):
            continue  # metadata, counters and flows carry no duration
        rank = _rank_of(raw, source, index)
        if ph == "X":
            events[rank].append(_complete(raw, source, index))
        elif ph in ("i", "I"):
            events[rank].append(Event(_name(raw, source, index), _number(raw, "ts", source, index)
                                      * 1e-6, 0.0, _args(raw, source, index)))
        elif ph in ("B", "E"):
            # Unsorted input: order each lane by time, ends before begins at a tie.
            lanes[(rank, raw.get("tid"))].append(
                (_number(raw, "ts", source, index), ph == "B", index, raw))
        else:
            raise TraceError(source, f"unsupported phase {ph!r}", index)
    for (rank, tid), lane in lanes.items():
        events[rank] += _spans(sorted(lane, key=lambda x: x[:3]), f"rank {rank}, tid {tid}", source)
    if not events:
        raise TraceError(source, "no events with a duration ('X', 'B'/'E' or 'i'): nothing to "
                         "analyse")
    for rank_events in events.values():
        rank_events.sort(key=lambda e: (e.start_s, -e.dur_s))
    return dict(events)


def _name(raw: Mapping[str, Any], source: str, index: int) -> str:
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise TraceError(source, f"'name' must be a non-empty string, got {name!r}", index)
    return name


def _args(raw: Mapping[str, Any], source: str, index: int) -> Mapping[str, Any]:
    """The event's arguments; those our analyses read must have their types."""
    args = raw.get("args") or {}
    if not isinstance(args, dict):
        raise TraceError(source, "'args' must be an object", index)
    for key in INT_ARGS:
        if args.get(key) is not None and not is_int32(args[key]):
            raise TraceError(source, f"args.{key} must be a 32-bit integer, got "
                             f"{_short(args[key])}", index)
    group = args.get("group")
    if group is not None and not (isinstance(group, list) and all(map(is_int32, group))):
        raise TraceError(source, f"args.group must be a list of 32-bit integer ranks, got "
                         f"{_short(group)}", index)
    size = args.get("bytes")
    if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float))
                             or not math.isfinite(size) or not 0 <= size < 2**63):
        raise TraceError(source, f"args.bytes must be a finite number in [0, 2**63), got "
                         f"{_short(size)}", index)
    if any(isinstance(v, (dict, list)) for v in args.values()) and structure_size(
            args)[0] > MAX_DEPTH:
        raise TraceError(source, f"args nested more than {MAX_DEPTH} levels deep", index)
    if any(k in args and args[k] is None for k in ANALYSED_ARGS):  # null: as if absent
        return {k: v for k, v in args.items() if v is not None or k not in ANALYSED_ARGS}
    return args


def _complete(raw: Mapping[str, Any], source: str, index: int) -> Event:
    dur = _number(raw, "dur", source, index)
    if dur < 0:
        raise TraceError(source, f"negative duration {dur}", index)
    return Event(_name(raw, source, index), _number(raw, "ts", source, index) * 1e-6,
                 dur * 1e-6, _args(raw, source, index))


def _spans(lane: list[tuple[float, bool, int, Mapping[str, Any]]], where: str,
           source: str) -> list[Event]:
    """Pair one lane's time-ordered B/E events (an E closes the latest open B of its name)."""
    stack: list[tuple[int, Mapping[str, Any]]] = []
    out = []
    for _, is_begin, index, raw in lane:
        if is_begin:
            stack.append((index, raw))
        else:
            out.append(_close(stack, raw, source, index))
    if stack:
        index, raw = stack[-1]
        raise TraceError(source, f"'B' event {raw.get('name')!r} ({where}) is never closed by an "
                         "'E'", index)
    return out


def _close(stack: list[tuple[int, Mapping[str, Any]]], end: Mapping[str, Any], source: str,
           index: int) -> Event:
    name = end.get("name")
    match = next((i for i in range(len(stack) - 1, -1, -1)
                  if name is None or stack[i][1].get("name") == name), None)
    if match is None:
        raise TraceError(source, f"'E' event {name!r} has no open 'B'", index)
    begin_index, begin = stack.pop(match)
    name = _name(begin, source, begin_index)
    start = _number(begin, "ts", source, begin_index)
    stop = _number(end, "ts", source, index)
    if stop < start:
        raise TraceError(source, f"'E' of {name!r} at {stop} is before its 'B' at {start}", index)
    args = {**_args(begin, source, begin_index), **_args(end, source, index)}
    return Event(name, start * 1e-6, (stop - start) * 1e-6, args)


def read_json(path: Path, max_bytes: float | None = None) -> Any:
    """A UTF-8 JSON file (gzipped if its name ends in .gz); anything else
    (binary, UTF-16, too deep, more text than ``max_bytes``) is one line."""
    return read_json_any(path, max_bytes)


def read_object(path: Path) -> dict[str, Any]:
    """A run directory's side file (its summary.json, say): a JSON object."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise TraceError(str(path), f"must hold a JSON object, got {type(data).__name__}")
    return data


def dig(data: Mapping[str, Any], path: str, source: Path) -> Any:
    """``data["a"]["b"]`` for ``path`` "a.b", or None where a level is missing;
    a level that is there but not an object is an error naming the file."""
    node: Any = data
    for part in path.split("."):
        if node is None:
            return None
        if not isinstance(node, dict):
            raise TraceError(str(source), f"{path}: expected an object at {part!r}")
        node = node.get(part)
    return node


def finite_field(obj: Mapping[str, Any], key: str, where: str, path: Path) -> float:
    value = obj.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value):
        raise TraceError(str(path), f"{where}.{key} must be a finite number, got {_short(value)}")
    return float(value)


def load_chrome_file(path: Path, max_bytes: float | None = None) -> RankEvents:
    return events_from_chrome(read_json(path, max_bytes), str(path))


def read_events(path: Path | str, max_bytes: float | None = None) -> RankEvents:
    """Events of one of our trace files (merged or per rank), in seconds, sorted
    (``max_bytes``: the cap on its JSON text, see ``kineto.read_json_any``)."""
    return load_chrome_file(Path(path), max_bytes)  # docs pass a string path


def merge_rank_files(paths: Iterable[Path], max_bytes: float | None = None) -> RankEvents:
    """Per-rank files (each in its own local clock) into one mapping."""
    merged: RankEvents = {}
    for path in paths:
        for rank, evs in load_chrome_file(path, max_bytes).items():
            if rank in merged:
                raise TraceError(str(path), f"rank {rank} also appears in another rank file")
            merged[rank] = evs
    return merged


def _rank_files(ranks_dir: Path) -> list[Path]:
    def rank_number(p: Path) -> int:
        digits = p.stem.removeprefix("rank")
        return int(digits) if digits.isdigit() else -1

    return sorted(ranks_dir.glob("rank*.json"), key=rank_number)


def load_store(path: Path, raw_clocks: bool, say: Say = quiet) -> LoadedTrace:
    """A run's ``trace.parquet``: with ``raw_clocks`` each rank on its own clock
    (unaligned, as a real job would hand it over), else in true time."""
    from megatronapp.trace.columns import RankEventsView, TableSource
    from megatronapp.trace.store import StoreError, local_clock_view, read_columns

    say(f"loading {path}")
    try:
        cols, meta = read_columns(path)
    except StoreError as err:
        raise TraceError(str(path), str(err).removeprefix(f"{path}: ")) from None
    if raw_clocks:
        cols = local_clock_view(cols, meta.clocks)
    run_dir = path.parent if path.name == TRACE_STORE else None
    return LoadedTrace(RankEventsView(TableSource(cols)), not raw_clocks, str(path), run_dir)


TRACE_STORE = "trace.parquet"


@dataclass(frozen=True)
class TraceFiles:
    """What ``load_trace`` reads for a target: a run's Parquet store, a run's
    per-rank files or merged trace, torch.profiler files, or one trace file."""

    kind: Literal["store", "ranks", "merged", "kineto", "file"]
    paths: tuple[Path, ...]
    raw_clocks: bool = False  # a store read on each rank's own clock
    run_dir: Path | None = None


def locate_trace(target: str | Path, raw_clocks: bool = True) -> TraceFiles:
    """The files ``load_trace(target, raw_clocks)`` reads, found without reading them."""
    path = Path(target)
    _gated(path, "any")  # names, links, special files: before anything is looked at
    if path.is_dir() and (path / TRACE_STORE).is_file():
        return TraceFiles("store", (path / TRACE_STORE,), raw_clocks, path)
    if path.suffix == ".parquet" and path.is_file():
        return TraceFiles("store", (path,))
    if path.is_dir():
        files = _rank_files(path / "ranks")
        if raw_clocks and files:
            return TraceFiles("ranks", tuple(files), run_dir=path)
        if (path / "trace.json").is_file():
            return TraceFiles("merged", (path / "trace.json",), run_dir=path)
        profiles = kineto_files(path)
        if profiles:
            return TraceFiles("kineto", tuple(profiles))
        raise TraceError(str(path), "no trace.parquet, ranks/rank*.json, trace.json or "
                         "torch.profiler traces (*.json, *.json.gz) in this directory")
    return TraceFiles("file", (_gated(path, "file"),))


def _gated(path: Path, kind: gate.Kind) -> Path:
    """``path`` through the input gate; what it refuses, as a TraceError naming the path."""
    try:
        gate.checked(path, "", kind)
    except gate.InputError as err:
        raise TraceError(str(path), err.reason(path)) from None
    return path


@dataclass(frozen=True)
class TraceSize:
    """A trace's size, known before reading its events: a store's row count
    (from the Parquet footer), else the bytes of JSON text to parse."""

    stored_events: int
    text_bytes: int


def trace_size(files: TraceFiles) -> TraceSize:
    if files.kind == "store":
        return TraceSize(sum(_stored_rows(p) for p in files.paths), 0)
    return TraceSize(0, sum(map(text_size, files.paths)))


def _stored_rows(path: Path) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        footer = pq.read_metadata(_gated(path, "file"))
        return int(_symmetric_events(footer.metadata) or footer.num_rows)
    except (OSError, pa.ArrowException) as err:
        raise TraceError(str(path), f"not a readable Parquet file ({str(err).splitlines()[0]})") \
            from None


def _symmetric_events(metadata: dict[bytes, bytes] | None) -> int | None:
    """The events a symmetric store expands to (its footer counts the stored rows)."""
    from megatronapp.trace.store import META_KEY

    raw = (metadata or {}).get(META_KEY)
    try:
        events = json.loads(raw).get("events") if raw is not None else None
    except (ValueError, AttributeError):
        return None  # read_meta names what is wrong with it
    return events if isinstance(events, int) and not isinstance(events, bool) else None


def load_trace(target: str | Path, raw_clocks: bool = True, say: Say = quiet,
               max_bytes: float | None = None, cycle: int | str = ALL) -> LoadedTrace:
    """A run directory, a directory of torch.profiler (Kineto) traces, or a
    single trace file (gzipped or not).

    A run directory is read from its ``trace.parquet`` (older ones: from
    ``ranks/``, or the merged ``trace.json``); with ``raw_clocks`` every rank
    keeps its own clock (unaligned, as a real job would hand it over). A
    single Chrome file is taken as it is (aligned if its metadata says so);
    Kineto files from one host share its clock, from several are aligned;
    their profiling cycles are merged (``cycle`` ``all``) or one is read (a
    number from 1). ``max_bytes`` caps each JSON file's text (see ``read_json_any``).
    """
    if cycle == EACH:
        raise ValueError("load_trace reads one trace; load_traces reads each cycle")
    (trace,) = load_traces(target, raw_clocks, say, max_bytes, cycle)
    return trace


def load_traces(target: str | Path, raw_clocks: bool = True, say: Say = quiet,
                max_bytes: float | None = None, cycle: int | str = EACH) -> list[LoadedTrace]:
    """``load_trace``, with a torch.profiler folder's cycles each read on its
    own (``each``): one trace per cycle (one for any other target)."""
    files = locate_trace(target, raw_clocks)
    source = str(Path(target))
    if files.kind == "store":
        return [load_store(files.paths[0], files.raw_clocks, say)]
    if files.kind == "ranks":
        say(f"loading {len(files.paths)} rank files")
        return [LoadedTrace(merge_rank_files(files.paths, max_bytes), False, source,
                            files.run_dir)]
    if files.kind == "merged":
        say(f"loading {files.paths[0]}")
        return [LoadedTrace(load_chrome_file(files.paths[0], max_bytes), True,
                            str(files.paths[0]), files.run_dir)]
    if files.kind == "kineto":
        say(f"loading {len(files.paths)} torch.profiler files")
        return [_from_kineto(job, source) for job in kineto_cycles(files.paths, max_bytes,
                                                                   cycle=cycle)]
    path = files.paths[0]
    say(f"loading {path}")
    data = read_json_any(path, max_bytes)
    if is_kineto(data):
        return [_from_kineto(job, str(path)) for job in kineto_cycles([path], max_bytes,
                                                                      cycle=cycle)]
    meta = data.get("metadata", {}) if isinstance(data, dict) else {}
    aligned = not isinstance(meta, dict) or meta.get("clock", "aligned") != "local"
    return [LoadedTrace(events_from_chrome(data, str(path)), aligned, str(path))]


def _from_kineto(job: KinetoJob, source: str) -> LoadedTrace:
    """One file is on its own clock; files of one host share it."""
    return LoadedTrace(job.events, job.one_clock or len(job.phases) == 1, source,
                       world_size=job.world_size, cycles=job.cycles)
