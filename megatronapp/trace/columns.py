"""Events as columns: one numpy array per field instead of one object per event.

A million-rank-operation run is stored, summarised and diagnosed as columns;
``Event`` objects are built only for the few ranks someone asks for. Absent
integer fields are -1 (iteration, microbatch, chunk, bytes, peer, group,
role, tag). Groups are ids into ``groups`` (tuples of global ranks); names are
codes into ``names``; kinds are ``kinds.event_kind`` of each event; a
point-to-point event's role is 0 (send) or 1 (recv) and its tag the encoded
one that pairs a send with its receive. Times are true (aligned) seconds.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Protocol, Sequence, TypeGuard

import numpy as np

from .kinds import event_kind
from ..parallel.ops import OP_KINDS
from .events import Event, RunResult

KINDS = (*OP_KINDS, "other")  # compute, p2p, collective, then annotations
ROLES = ("send", "recv")
INT_FIELDS = ("iteration", "microbatch", "chunk")
KNOWN_ARGS = frozenset(INT_FIELDS) | {"bytes", "peer", "group", "kind", "role", "tag"}


@dataclass(frozen=True)
class EventColumns:
    rank: np.ndarray  # int32
    name: np.ndarray  # int16 codes into ``names``
    kind: np.ndarray  # int8 codes into KINDS
    start_s: np.ndarray  # float64
    dur_s: np.ndarray  # float64
    iteration: np.ndarray  # int32
    microbatch: np.ndarray  # int32
    chunk: np.ndarray  # int32
    nbytes: np.ndarray  # int64
    peer: np.ndarray  # int32
    group: np.ndarray  # int32 ids into ``groups``
    role: np.ndarray  # int8 codes into ROLES
    tag: np.ndarray  # int64
    names: tuple[str, ...]
    groups: tuple[tuple[int, ...], ...]
    extra: np.ndarray | None = None  # object: JSON text of other args, or None

    def __len__(self) -> int:
        return len(self.rank)

    @property
    def end_s(self) -> np.ndarray:
        return self.start_s + self.dur_s

    def name_code(self, name: str) -> int:
        """The code of ``name`` (-1 if no event has it)."""
        return self.names.index(name) if name in self.names else -1

    def take(self, index: np.ndarray | slice) -> "EventColumns":
        """The rows ``index`` (a boolean mask, an index array or a slice)."""
        arrays = {f: getattr(self, f)[index] for f in ARRAY_FIELDS}
        extra = self.extra[index] if self.extra is not None else None
        return EventColumns(**arrays, names=self.names, groups=self.groups, extra=extra)

    def sorted_by_rank_and_start(self) -> "EventColumns":
        order = np.lexsort((-self.dur_s, self.start_s, self.rank))
        return self.take(order)

    def rank_bounds(self) -> dict[int, tuple[int, int]]:
        """rank -> (first row, end row); rows must be grouped by rank."""
        if not len(self):
            return {}
        cuts = np.flatnonzero(np.diff(self.rank)) + 1
        starts = np.concatenate(([0], cuts))
        ends = np.concatenate((cuts, [len(self)]))
        return {int(self.rank[s]): (int(s), int(e)) for s, e in zip(starts, ends)}


ARRAY_FIELDS = ("rank", "name", "kind", "start_s", "dur_s", "iteration", "microbatch", "chunk",
                "nbytes", "peer", "group", "role", "tag")
TIMELESS_FIELDS = tuple(f for f in ARRAY_FIELDS if f not in ("start_s", "dur_s"))
DTYPES = {"rank": np.int32, "name": np.int16, "kind": np.int8, "start_s": np.float64,
          "dur_s": np.float64, "iteration": np.int32, "microbatch": np.int32,
          "chunk": np.int32, "nbytes": np.int64, "peer": np.int32, "group": np.int32,
          "role": np.int8, "tag": np.int64}


# the largest value each integer arg's column holds, by the arg's name in a trace
ARG_MAX = {**{f: int(np.iinfo(np.int32).max) for f in INT_FIELDS},
           "peer": int(np.iinfo(np.int32).max), "bytes": int(np.iinfo(np.int64).max),
           "tag": int(np.iinfo(np.int64).max)}  # as DTYPES stores them

INT32 = np.iinfo(np.int32)  # the dtype of ranks, peers, groups and indices above


def is_int32(value: Any) -> TypeGuard[int]:
    """An integer (not a bool) the 32-bit columns (ranks, indices) can hold."""
    return isinstance(value, int) and not isinstance(value, bool) and INT32.min <= value <= INT32.max


def empty_columns() -> EventColumns:
    return EventColumns(**{f: np.zeros(0, DTYPES[f]) for f in ARRAY_FIELDS}, names=(), groups=())


def whole_ranks(batches: Iterable[EventColumns]) -> Iterator[EventColumns]:
    """The same rows re-cut so that no rank is split between two batches
    (rows must arrive grouped by rank)."""
    tail: EventColumns | None = None
    for cols in batches:
        if tail is not None:
            cols = concat_same([tail, cols])
        if not len(cols):
            continue
        others = np.flatnonzero(cols.rank != cols.rank[-1])
        cut = int(others[-1]) + 1 if len(others) else 0  # where the last rank's rows begin
        if cut:
            yield cols.take(slice(0, cut))
        tail = cols.take(slice(cut, len(cols)))
    if tail is not None and len(tail):
        yield tail


def concat_same(parts: Sequence[EventColumns]) -> EventColumns:
    """One table from parts that share their name and group tables."""
    if not parts:
        return empty_columns()
    first = parts[0]
    if any(p.names != first.names or p.groups is not first.groups for p in parts):
        return concat_columns(parts)
    # nothing to re-code: a job's group table (tens of thousands of groups at
    # 98,304 GPUs) is not hashed again for every part
    return EventColumns(**{f: np.concatenate([getattr(p, f) for p in parts])
                           .astype(DTYPES[f], copy=False) for f in ARRAY_FIELDS},
                        names=first.names, groups=first.groups, extra=_concat_extra(parts))


def _concat_extra(parts: Sequence[EventColumns]) -> np.ndarray | None:
    """The parts' args (None where a part has none), or None if none has any."""
    if all(p.extra is None for p in parts):
        return None
    return np.concatenate([p.extra if p.extra is not None else np.full(len(p), None, object)
                           for p in parts])


def concat_columns(parts: Sequence[EventColumns]) -> EventColumns:
    """One table from several, re-coding names and groups into shared tables."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return empty_columns()
    names = tuple(dict.fromkeys(n for p in parts for n in p.names))
    groups = tuple(dict.fromkeys(g for p in parts for g in p.groups))
    name_id = {n: i for i, n in enumerate(names)}
    group_id = {g: i for i, g in enumerate(groups)}
    arrays: dict[str, list[np.ndarray]] = {f: [] for f in ARRAY_FIELDS}
    for p in parts:
        for f in ARRAY_FIELDS:
            arrays[f].append(getattr(p, f))
        arrays["name"][-1] = np.array([name_id[n] for n in p.names], np.int16)[p.name] \
            if p.names else p.name
        gmap = np.array([group_id[g] for g in p.groups] + [-1], np.int32)
        arrays["group"][-1] = gmap[p.group]  # -1 indexes the trailing -1
    return EventColumns(**{f: np.concatenate(v).astype(DTYPES[f], copy=False)
                           for f, v in arrays.items()}, names=names, groups=groups,
                        extra=_concat_extra(parts))


# --------------------------------------------------------- from / to events
def _int(value: Any, key: str) -> int:
    """``value`` where its column can hold it, else -1 (the value then stays
    among the event's other args, see ``_other_args``)."""
    return value if isinstance(value, int) and not isinstance(value, bool) \
        and 0 <= value <= ARG_MAX[key] else -1


def _other_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """Arguments without a column of their own (or with a value it cannot hold)."""
    out = {}
    for k, v in args.items():
        if k == "group":
            if not isinstance(v, (list, tuple)):
                out[k] = v
        elif k == "kind":
            if v not in OP_KINDS:  # a foreign kind: the column holds its classification
                out[k] = v
        elif k == "role":
            if v not in ROLES:
                out[k] = v
        elif k not in KNOWN_ARGS or _int(v, k) != v:
            out[k] = v
    return out


def columns_from_events(events: Mapping[int, Sequence[Event]]) -> EventColumns:
    """Columns of per-rank ``Event`` lists (rows grouped by rank, in list order)."""
    names: dict[str, int] = {}
    groups: dict[tuple[int, ...], int] = {}
    rows: dict[str, list[Any]] = {f: [] for f in ARRAY_FIELDS}
    extra: list[str | None] = []
    for rank in sorted(events):
        for e in events[rank]:
            a = e.args
            group = a.get("group")
            rows["rank"].append(rank)
            rows["name"].append(names.setdefault(e.name, len(names)))
            rows["kind"].append(KINDS.index(event_kind(e.name, a)))
            rows["role"].append(ROLES.index(a["role"]) if a.get("role") in ROLES else -1)
            rows["tag"].append(_int(a.get("tag"), "tag"))
            rows["start_s"].append(e.start_s)
            rows["dur_s"].append(e.dur_s)
            for f in INT_FIELDS:
                rows[f].append(_int(a.get(f), f))
            rows["nbytes"].append(_int(a.get("bytes"), "bytes"))
            rows["peer"].append(_int(a.get("peer"), "peer"))
            rows["group"].append(groups.setdefault(tuple(group), len(groups))
                                 if isinstance(group, (list, tuple)) else -1)
            other = _other_args(a)
            extra.append(json.dumps(other, default=str) if other else None)
    has_extra = any(x is not None for x in extra)
    return EventColumns(**{f: np.asarray(v, DTYPES[f]) if v else np.zeros(0, DTYPES[f])
                           for f, v in rows.items()},
                        names=tuple(names), groups=tuple(groups),
                        extra=np.asarray(extra, object) if has_extra else None)


def event_args(cols: EventColumns, i: int) -> dict[str, Any]:
    """Row ``i``'s args as a backend records them (``ops.trace_args``); an
    event classified rather than recorded gets its class as ``kind``."""
    args: dict[str, Any] = {}
    for f in INT_FIELDS:
        v = int(getattr(cols, f)[i])
        if v >= 0:
            args[f] = v
    if cols.kind[i] < len(OP_KINDS):
        args["kind"] = KINDS[cols.kind[i]]
    if cols.nbytes[i] >= 0:
        args["bytes"] = int(cols.nbytes[i])
    if cols.peer[i] >= 0:
        args["peer"] = int(cols.peer[i])
    if cols.group[i] >= 0:
        args["group"] = list(cols.groups[cols.group[i]])
    if cols.role[i] >= 0:
        args["role"] = ROLES[cols.role[i]]
    if cols.tag[i] >= 0:
        args["tag"] = int(cols.tag[i])
    if cols.extra is not None and cols.extra[i] is not None:
        args.update(json.loads(cols.extra[i]))  # last: a foreign kind or role wins
    return args


def events_of_rows(cols: EventColumns, lo: int, hi: int) -> list[Event]:
    starts, durs = cols.start_s[lo:hi].tolist(), cols.dur_s[lo:hi].tolist()
    return [Event(cols.names[cols.name[i]], starts[i - lo], durs[i - lo], event_args(cols, i))
            for i in range(lo, hi)]


class EventSource(Protocol):
    """Where a run's events come from: a table in memory, or a compact run
    that expands its rows on demand. ``compact``: the rows of the ranks that
    stand for others and how many each stands for; ``weighted_batches``: the
    same rows a few whole pipelines at a time (both sides of every transfer in
    one batch), for summaries that must not hold every row at once."""

    @property
    def events(self) -> int: ...
    @property
    def groups(self) -> tuple[tuple[int, ...], ...]: ...
    def ranks(self) -> Sequence[int]: ...
    def batches(self, max_rows: int = ...) -> Iterator[EventColumns]: ...
    def compact(self) -> tuple[EventColumns, np.ndarray]: ...
    def weighted_batches(self, max_rows: int = ...) -> Iterator[tuple[EventColumns, np.ndarray]]: ...
    def stand_ins(self) -> dict[int, tuple[int, ...]]: ...
    def rank_rows(self, rank: int) -> EventColumns: ...


class TableSource:
    """An ``EventSource`` over one table held in memory (rows grouped by rank)."""

    def __init__(self, cols: EventColumns):
        self.table = cols
        self._bounds = cols.rank_bounds()

    @property
    def events(self) -> int:
        return len(self.table)

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        return self.table.groups

    def ranks(self) -> Sequence[int]:
        return list(self._bounds)

    def batches(self, max_rows: int = 1 << 20) -> Iterator[EventColumns]:
        for lo in range(0, len(self.table), max_rows):
            yield self.table.take(slice(lo, lo + max_rows))

    def compact(self) -> tuple[EventColumns, np.ndarray]:
        return self.table, np.ones(len(self.table))

    def weighted_batches(self, max_rows: int = 1 << 20) -> Iterator[tuple[EventColumns, np.ndarray]]:
        yield self.compact()  # already in memory: one batch

    def stand_ins(self) -> dict[int, tuple[int, ...]]:
        return {r: (r,) for r in self._bounds}

    def rank_rows(self, rank: int) -> EventColumns:
        lo, hi = self._bounds[rank]
        return self.table.take(slice(lo, hi))


def source_of(result: RunResult) -> EventSource:
    """A run's events as an ``EventSource`` (columns built here for object events)."""
    if result.source is not None:
        return result.source  # type: ignore[no-any-return]
    return TableSource(columns_from_events(result.events))


class RankEventsView(Mapping[int, list[Event]]):
    """``dict[rank, list[Event]]`` built rank by rank, on demand (small runs and
    tests; large runs stay columnar)."""

    def __init__(self, source: EventSource):
        self.source = source
        self._ranks = list(source.ranks())
        self._known = set(self._ranks)
        self._cache: dict[int, list[Event]] = {}

    def __getitem__(self, rank: int) -> list[Event]:
        if rank not in self._known:
            raise KeyError(rank)
        if rank not in self._cache:
            rows = self.source.rank_rows(rank)
            self._cache[rank] = events_of_rows(rows, 0, len(rows))
        return self._cache[rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ranks)

    def __len__(self) -> int:
        return len(self._ranks)
