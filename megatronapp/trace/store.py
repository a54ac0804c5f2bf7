"""A run's events on disk: one Parquet file, written while streaming, read as columns.

``trace.parquet`` holds one row per event in true (aligned) seconds: rank,
name, kind, start_s, dur_s, iteration, microbatch, chunk, bytes, peer, group
(an id into the groups in the file's metadata), role (0 send, 1 recv), tag
(what pairs a send with its receive), and ``args`` (JSON of any other
arguments) when some event has them. Absent values are nulls. The
file's metadata (key ``megatronapp``) holds the format version, the world
size, the groups and every rank clock that is not the identity: a rank's
local-clock view (what its own profiler would have written) is
``local = true·(1 + drift) + offset``, applied on reading.

Rows are written in batches (row groups) as the run expands them, so memory
stays bounded by one batch; DuckDB and pyarrow read the file directly. Each
row group holds whole ranks, ascending; a compiled run's, the ranks of whole
data-parallel replicas of one stage (about ``ROW_GROUP`` rows, one replica at
least), so that a reader of some ranks (``read_columns(ranks=...)``, the
detector's cut of a few replicas) decodes only the row groups that hold
them (``row_groups_of``, from the footer's rank statistics).

A run with classes of identical ranks (the simulator's symmetry reduction)
stores only its representatives' rows (format 2): the metadata adds
``classes`` (representative -> the ranks it stands for) and ``events`` (the
rows every rank's view holds). ``read_columns`` and ``iter_columns`` expand
them (``trace.classes``), so their callers see every rank as in format 1.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from .classes import Expansion, StandIns, rank_groups
from .columns import DTYPES, KINDS, TIMELESS_FIELDS, EventColumns, EventSource, TableSource
from .events import RankClock
from ..io import gate
from ..io.text import TextError, load_json_bytes

FORMAT = 1  # one row per event of every rank
SYMMETRIC = 2  # the representatives' rows and the classes they stand for (``classes``)
META_KEY = b"megatronapp"
TRACE_FILE = "trace.parquet"
NULLABLE = ("iteration", "microbatch", "chunk", "nbytes", "peer", "group", "role", "tag")
COLUMN_OF = {"nbytes": "bytes"}  # field -> column name where they differ
ROW_GROUP = 1 << 18  # rows a row group (and a batch being written) holds about
TIMES = ("start_s", "dur_s")  # written without a dictionary (nearly every value distinct)
PRUNED_BY = ("rank", "iteration")  # the columns readers skip row groups by (footer min/max)
INT32_MAX = int(np.iinfo(np.int32).max)


class StoreError(ValueError):
    """An unreadable or foreign Parquet file (the message names it)."""


def _clock(rank: Any, offset: Any, drift: Any) -> RankClock:
    """A rank's clock from the metadata: finite numbers only."""
    values = (float(offset), float(drift))
    if not all(map(math.isfinite, values)):
        raise ValueError(f"clocks: rank {rank}: offset and drift must be finite numbers, got "
                         f"{offset!r}, {drift!r}")
    return RankClock(*values)


@dataclass(frozen=True)
class StoreMeta:
    world_size: int
    groups: tuple[tuple[int, ...], ...]
    clocks: dict[int, RankClock] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. gpus_per_node

    @property
    def stand_ins(self) -> StandIns | None:
        """A symmetric store's classes (None: every rank's rows are stored)."""
        classes = self.extra.get("classes")
        return StandIns.from_json(classes, self.world_size) if classes is not None else None

    def to_json(self) -> dict[str, Any]:
        layout = SYMMETRIC if "classes" in self.extra else FORMAT
        return {"format": layout, "world_size": self.world_size,
                "groups": [list(g) for g in self.groups],
                "clocks": {str(r): [c.offset_us, c.drift_ppm] for r, c in self.clocks.items()
                           if c != RankClock()}, **self.extra}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "StoreMeta":
        clocks = {int(r): _clock(r, o, d) for r, (o, d) in data["clocks"].items()}
        extra = {k: v for k, v in data.items()
                 if k not in ("format", "world_size", "groups", "clocks")}
        if "classes" in extra:  # a symmetric store's classes, checked before any row is read
            StandIns.from_json(extra["classes"], int(data["world_size"]))
        return cls(int(data["world_size"]), tuple(tuple(int(x) for x in g) for g in data["groups"]),
                   clocks, extra)


def _schema(with_args: bool, meta: StoreMeta) -> pa.Schema:
    fields = [pa.field("rank", pa.int32(), nullable=False),
              pa.field("name", pa.dictionary(pa.int16(), pa.string()), nullable=False),
              pa.field("kind", pa.dictionary(pa.int8(), pa.string()), nullable=False),
              pa.field("start_s", pa.float64(), nullable=False),
              pa.field("dur_s", pa.float64(), nullable=False)]
    fields += [pa.field(COLUMN_OF.get(f, f), pa.from_numpy_dtype(DTYPES[f])) for f in NULLABLE]
    if with_args:
        fields.append(pa.field("args", pa.string()))
    return pa.schema(fields, metadata={META_KEY: json.dumps(meta.to_json()).encode()})


def _batch(cols: EventColumns, schema: pa.Schema) -> pa.RecordBatch:
    arrays: list[pa.Array] = [
        pa.array(cols.rank, pa.int32()),
        pa.DictionaryArray.from_arrays(pa.array(cols.name, pa.int16()),
                                       pa.array(cols.names, pa.string())),
        pa.DictionaryArray.from_arrays(pa.array(cols.kind, pa.int8()), pa.array(KINDS)),
        pa.array(cols.start_s, pa.float64()), pa.array(cols.dur_s, pa.float64())]
    for f in NULLABLE:
        values = getattr(cols, f)
        arrays.append(pa.array(values, pa.from_numpy_dtype(DTYPES[f]), mask=values < 0))
    if "args" in schema.names:
        extra = cols.extra if cols.extra is not None else np.full(len(cols), None, object)
        arrays.append(pa.array(extra, pa.string()))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def write_events(path: Path, source: EventSource, meta: StoreMeta,
                 on_rows: Callable[[int], None] = lambda _n: None,
                 max_rows: int = ROW_GROUP) -> int:
    """Stream every event of ``source`` into ``path``; returns the rows written."""
    batches = source.batches(max_rows)
    held = [cols for cols in [next(batches, None)] if cols is not None]  # the schema needs it
    schema = _schema(bool(held) and held[0].extra is not None, meta)
    rows = 0
    # a dictionary of the times would be tried, cost CPU and be dropped
    coded = [name for name in schema.names if name not in TIMES]
    # min/max only where a reader prunes by them (rank ranges, iteration bounds):
    # stating them for every column was a sixth of the writer's time
    with pq.ParquetWriter(path, schema, compression="zstd", use_dictionary=coded,
                          write_statistics=list(PRUNED_BY)) as writer:
        while (cols := held.pop() if held else next(batches, None)) is not None:
            # each batch one row group (its ranks whole), and one held at a time
            writer.write_batch(_batch(cols, schema), row_group_size=max(max_rows, len(cols)))
            rows += len(cols)
            on_rows(len(cols))
            del cols
    return rows


# ------------------------------------------------------------------ reading
def read_meta(path: Path) -> StoreMeta:
    try:
        schema = pq.read_schema(gate.checked(path, ""))
    except (OSError, pa.ArrowException) as err:
        raise StoreError(f"{path}: not a readable Parquet file ({str(err).splitlines()[0]})") \
            from None
    except gate.InputError as err:
        raise StoreError(str(err)) from None
    raw = (schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise StoreError(f"{path}: not a megatronapp event table (no '{META_KEY.decode()}' "
                         "metadata)")
    try:
        data = load_json_bytes(raw, "its metadata")
    except TextError as err:
        raise StoreError(f"{path}: {err}") from None
    if not isinstance(data, dict) or data.get("format") not in (FORMAT, SYMMETRIC):
        shown = data.get("format") if isinstance(data, dict) else data
        raise StoreError(f"{path}: event table format {shown!r:.40}, this version "
                         f"reads {FORMAT} and {SYMMETRIC}")
    try:
        return StoreMeta.from_json(data)
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise StoreError(f"{path}: metadata '{META_KEY.decode()}': {_meta_problem(err)}") \
            from None


def _meta_problem(err: Exception) -> str:
    if isinstance(err, KeyError):
        return f"no {err.args[0]!r}"
    return str(err).splitlines()[0][:120] if isinstance(err, ValueError) else \
        "a field of the wrong type (world_size, groups, clocks)"


def iteration_bound(path: Path) -> int:
    """One past the largest iteration the store holds, from its footer's column
    statistics (no row read; 0 when it holds none)."""
    footer = pq.read_metadata(gate.checked(path, ""))
    column = footer.schema.names.index("iteration")
    top = -1
    for g in range(footer.num_row_groups):
        stats = footer.row_group(g).column(column).statistics
        if stats is None or not stats.has_min_max:
            return INT32_MAX  # not stated: only what the int32 column holds bounds it
        top = max(top, int(stats.max))
    return top + 1


def row_groups_of(path: Path, ranks: Sequence[int]) -> list[int]:
    """The row groups whose ranks (their footer's min and max) may hold one of
    ``ranks``: a store written by ``write_events`` holds whole ranks per row
    group, a compiled run's whole data-parallel replicas of one stage."""
    return _row_groups(_rank_ranges(path), ranks)


def _rank_ranges(path: Path) -> np.ndarray:
    """Each row group's (min, max) rank from the footer; the widest range where
    it is not stated (then the group is read)."""
    footer = pq.read_metadata(gate.checked(path, ""))
    column = footer.schema.names.index("rank")
    out = np.empty((footer.num_row_groups, 2), np.int64)
    for g in range(footer.num_row_groups):
        stats = footer.row_group(g).column(column).statistics
        stated = stats is not None and stats.has_min_max
        out[g] = (int(stats.min), int(stats.max)) if stated else (-INT32_MAX, INT32_MAX)
    return out


def _row_groups(ranges: np.ndarray, ranks: Sequence[int]) -> list[int]:
    wanted = np.unique(np.asarray(ranks, np.int64))
    first = np.searchsorted(wanted, ranges[:, 0])
    hit = first < len(wanted)
    hit[hit] &= wanted[first[hit]] <= ranges[hit, 1]
    return np.flatnonzero(hit).tolist()


@dataclass
class CutReader:
    """A full store read cut by cut (a detector's batches of replicas): its
    metadata, footer and dataset read once, not once a cut (at 98,304 GPUs
    the metadata alone is megabytes of JSON, the footer thousands of groups)."""

    path: Path
    meta: StoreMeta = field(init=False)
    _dataset: ds.Dataset = field(init=False)
    _ranges: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.meta = read_meta(self.path)
        self._dataset = _dataset(self.path)
        self._ranges = _rank_ranges(self.path)

    def columns(self, ranks: Sequence[int] | None, iterations: Sequence[int] | None,
                with_args: bool = False) -> EventColumns:
        """The rows of ``ranks`` (all: None) in ``iterations`` (all: None)."""
        if self.meta.stand_ins is not None:
            raise StoreError(f"{self.path}: a symmetric store is expanded, not cut")
        return _read_stored(self.path, self.meta, ranks, iterations, with_args,
                            (self._dataset, self._ranges))


def _filter(ranks: Sequence[int] | None, iterations: Sequence[int] | None) -> Any:
    out = None
    if ranks is not None:
        out = ds.field("rank").isin(list(ranks))
    if iterations is not None:
        by_iteration = ds.field("iteration").isin(list(iterations))
        out = by_iteration if out is None else out & by_iteration
    return out


def read_columns(path: Path, ranks: Sequence[int] | None = None,
                 iterations: Sequence[int] | None = None,
                 with_args: bool = True) -> tuple[EventColumns, StoreMeta]:
    """The events (all, or those of ``ranks`` / ``iterations``) and the file's
    metadata; ``with_args=False`` leaves out the JSON args column (what the
    typed columns do not hold: a detector needs none of it). A symmetric
    store's rows are expanded to every rank they stand for."""
    meta = read_meta(path)
    stand_ins = meta.stand_ins
    stored = _read_stored(path, meta, ranks if stand_ins is None else
                          (stand_ins.stands_for(ranks) if ranks is not None else None),
                          iterations, with_args)
    if stand_ins is None:
        return stored, meta
    expansion = Expansion(stored, stand_ins)
    return expansion.rows(expansion.ranks() if ranks is None else sorted(set(ranks))), meta


def read_source(path: Path, with_args: bool = False) -> EventSource:
    """The store as an ``EventSource``: a symmetric store's ``compact`` view is
    its stored rows, weighted, with nothing expanded; a full store's is every row."""
    meta = read_meta(path)
    stored = _read_stored(path, meta, None, None, with_args)
    stand_ins = meta.stand_ins
    return TableSource(stored) if stand_ins is None else Expansion(stored, stand_ins)


def _read_stored(path: Path, meta: StoreMeta, ranks: Sequence[int] | None,
                 iterations: Sequence[int] | None, with_args: bool,
                 opened: tuple[ds.Dataset, np.ndarray] | None = None) -> EventColumns:
    """The rows as stored (a symmetric store: the representatives'); of
    ``ranks``: only the row groups that hold one of them are decoded.
    ``opened``: the store's dataset and row groups' rank ranges, read already."""
    dataset, ranges = opened if opened is not None else (_dataset(path), None)
    names = [n for n in dataset.schema.names if with_args or n != "args"]
    if ranks is not None:
        fragment = next(iter(dataset.get_fragments()))
        groups = _row_groups(_rank_ranges(path) if ranges is None else ranges, ranks)
        dataset = ds.FileSystemDataset([fragment.subset(row_group_ids=groups)],
                                       dataset.schema, dataset.format, dataset.filesystem)
    cols = _columns(dataset.to_table(columns=names, filter=_filter(ranks, iterations)), meta)
    # the Arrow table is numpy columns now: its pages go back to the system, not
    # kept by Arrow's allocator beside what the caller builds next
    pa.default_memory_pool().release_unused()
    return cols


def _dataset(path: Path) -> ds.Dataset:
    """The store as a dataset whose args are read dictionary-encoded, as they
    are stored: a run's few distinct args are never decoded once per row."""
    return ds.dataset(gate.checked(path, ""), format=ds.ParquetFileFormat(
        read_options={"dictionary_columns": ["args"]}))


def iter_columns(path: Path, ranks: Sequence[int] | None = None,
                 iterations: Sequence[int] | None = None,
                 max_rows: int = ROW_GROUP) -> Iterator[EventColumns]:
    """The same rows batch by batch (bounded memory, e.g. for exports)."""
    meta = read_meta(path)
    stand_ins = meta.stand_ins
    if stand_ins is not None:  # the stored rows are few: expanded a batch of ranks at a time
        wanted = None if ranks is None else stand_ins.stands_for(ranks)
        expansion = Expansion(_read_stored(path, meta, wanted, iterations, True), stand_ins)
        chosen = expansion.ranks() if ranks is None else sorted(set(ranks))
        yield from (cols for cols in expansion.batches(max_rows, chosen) if len(cols))
        return
    dataset = _dataset(path)
    for batch in dataset.to_batches(filter=_filter(ranks, iterations), batch_size=max_rows):
        if batch.num_rows:
            yield _columns(pa.Table.from_batches([batch]), meta)


def _ints(table: pa.Table, name: str, dtype: Any) -> np.ndarray:
    """A nullable integer column as numpy, nulls as -1, written chunk by chunk
    into one array (from the buffers: ``fill_null`` copies every chunk twice,
    and whole-column temporaries of 47 M rows cost their pages each time)."""
    column = table.column(name)
    out = np.empty(len(column), dtype)
    start = 0
    for chunk in column.chunks:
        n = len(chunk)
        mine = out[start:start + n]
        start += n
        if chunk.null_count == 0:
            mine[:] = chunk.to_numpy(zero_copy_only=False)
            continue
        validity, data = chunk.buffers()[:2]
        mine[:] = np.frombuffer(data, chunk.type.to_pandas_dtype())[chunk.offset:chunk.offset + n]
        bits = np.unpackbits(np.frombuffer(validity, np.uint8), count=chunk.offset + n,
                             bitorder="little")[chunk.offset:]
        mine[bits == 0] = -1
    return out


def _codes(column: pa.ChunkedArray) -> tuple[np.ndarray, tuple[str, ...]]:
    if column.num_chunks == 0:
        return np.zeros(0, np.int16), ()
    combined = column.unify_dictionaries().combine_chunks() if column.num_chunks > 1 else \
        column.chunk(0)
    return (combined.indices.to_numpy(zero_copy_only=False).astype(np.int16),
            tuple(combined.dictionary.to_pylist()))


def _args(column: pa.ChunkedArray) -> np.ndarray:
    """The JSON args column as objects, one string object per distinct value
    (the compiled engine's layer/part arguments repeat across millions of rows)."""
    if not pa.types.is_dictionary(column.type):
        encoded = column.combine_chunks().dictionary_encode()
    elif column.num_chunks:
        encoded = column.unify_dictionaries().combine_chunks()
    else:
        encoded = pa.array([], column.type)
    distinct = np.asarray([*encoded.dictionary.to_pylist(), None], object)  # -1: no args
    return distinct[pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False)]


def _columns(table: pa.Table, meta: StoreMeta) -> EventColumns:
    name, names = _codes(table.column("name"))
    kind_codes, kinds = _codes(table.column("kind"))
    kind = np.array([KINDS.index(k) for k in kinds], np.int8)[kind_codes] if kinds else \
        np.zeros(0, np.int8)
    arrays = {f: _ints(table, COLUMN_OF.get(f, f), DTYPES[f]) for f in NULLABLE}
    extra = _args(table.column("args")) if "args" in table.column_names else None
    return EventColumns(rank=table.column("rank").to_numpy().astype(np.int32, copy=False),
                        name=name, kind=kind,
                        start_s=table.column("start_s").to_numpy(),
                        dur_s=table.column("dur_s").to_numpy(), **arrays,
                        names=names, groups=meta.groups, extra=extra)


def local_clock_view(cols: EventColumns, clocks: Mapping[int, RankClock]) -> EventColumns:
    """Each rank's events on its own (skewed) clock, as its profiler would record them."""
    if not clocks:
        return cols
    scale = np.ones(len(cols))
    offset = np.zeros(len(cols))
    for rank, clock in clocks.items():
        mine = cols.rank == rank
        scale[mine] = 1.0 + clock.drift_ppm * 1e-6
        offset[mine] = clock.offset_us * 1e-6
    start = cols.start_s * scale + offset
    end = (cols.start_s + cols.dur_s) * scale + offset
    return EventColumns(**{**{f: getattr(cols, f) for f in TIMELESS_FIELDS},
                           "start_s": start, "dur_s": end - start},
                        names=cols.names, groups=cols.groups, extra=cols.extra)


def expanded_view(con: Any, path: Path, name: str = "events") -> None:
    """A DuckDB view ``name`` (on connection ``con``) with every rank's rows of
    the store at ``path``, in the store's columns: a symmetric store's
    representatives' rows joined with its classes, each member's rank, peer
    and group moved as ``trace.classes`` moves them (computed as the view is read)."""
    quoted = "'" + str(path).replace("'", "''") + "'"
    stand_ins = read_meta(path).stand_ins
    if stand_ins is None:
        con.execute(f'CREATE VIEW "{name}" AS SELECT * FROM read_parquet({quoted})')
        return
    groups = rank_groups(read_meta(path).groups, stand_ins.world)
    members = pa.table({"rank": np.arange(stand_ins.world, dtype=np.int32),
                        "representative": stand_ins.representative().astype(np.int32),
                        "groups": pa.array(groups.tolist(), pa.list_(pa.int64()))})
    con.register(f"{name}_members", members)
    con.execute(f"""CREATE VIEW "{name}" AS
        SELECT t.* REPLACE (m.rank AS rank, t.peer + (m.rank - t.rank) AS peer,
               m.groups[list_position(r.groups, t."group")]::INTEGER AS "group")
        FROM read_parquet({quoted}) t
        JOIN "{name}_members" m ON m.representative = t.rank
        JOIN "{name}_members" r ON r.rank = t.rank""")


# ------------------------------------------------------- reading in pieces
PIECE_FIELDS = ("iteration", "microbatch")  # what a store's rows are split by
_ROW = "__row"  # a row's place in the file: pieces put back together keep the file's order


@dataclass(frozen=True)
class Pieces:
    """A store's rows (typed columns, no args) split by (iteration,
    microbatch) in one pass, each piece held as a compressed Arrow stream:
    any set of pieces is read back as columns without decoding the file again,
    and memory holds about the file's compressed size, not its rows. A
    symmetric store's pieces are its stored rows, expanded when read back;
    ``events`` counts every rank's rows either way."""

    path: Path
    meta: StoreMeta
    streams: Mapping[tuple[int, int], pa.Buffer]
    events: Mapping[tuple[int, int], int]

    def stored(self, keys: Sequence[tuple[int, int]], ranks: np.ndarray | None = None
               ) -> EventColumns:
        """The stored rows of the pieces ``keys``, in the file's order (a
        symmetric store's representatives' only); of ``ranks`` only, when
        given: one piece is decoded at a time and kept only for them."""
        wanted = None if ranks is None else pa.array(np.asarray(ranks, np.int64))
        tables = []
        for k in keys:
            table = pa.ipc.open_stream(self.streams[k]).read_all()
            if wanted is not None:
                table = table.filter(pc.is_in(pc.cast(table.column("rank"), pa.int64()),
                                              value_set=wanted))
            tables.append(table)
        table = pa.concat_tables(tables) if tables else _empty_table(self.path)
        order = np.argsort(table.column(_ROW).to_numpy(), kind="stable")
        return _columns(table.drop_columns([_ROW]).take(order), self.meta)

    def columns(self, keys: Sequence[tuple[int, int]], ranks: np.ndarray | None = None
                ) -> EventColumns:
        """The rows of the pieces ``keys``, in the file's order (every rank's,
        or ``ranks``' only)."""
        stand_ins = self.meta.stand_ins
        if stand_ins is None:
            return self.stored(keys, ranks)
        expansion = Expansion(self.stored(keys), stand_ins)
        return expansion.rows(expansion.ranks() if ranks is None else np.asarray(ranks).tolist())


def read_pieces(path: Path, max_rows: int | None = None) -> Pieces:
    """``path`` split by ``PIECE_FIELDS``, reading ``max_rows`` rows
    (``ROW_GROUP``) at a time."""
    meta = read_meta(path)
    dataset = ds.dataset(gate.checked(path, ""), format="parquet")
    names = [n for n in dataset.schema.names if n != "args"]
    weight = _row_weights(meta)
    sinks: dict[tuple[int, int], tuple[pa.BufferOutputStream, Any]] = {}
    events: dict[tuple[int, int], int] = {}
    options = pa.ipc.IpcWriteOptions(compression="lz4")  # fast: each piece is read back once
    offset = 0
    for batch in dataset.to_batches(columns=names, batch_size=max_rows or ROW_GROUP):
        batch = batch.append_column(_ROW, pa.array(np.arange(offset, offset + batch.num_rows)))
        offset += batch.num_rows
        key = np.stack([pc.fill_null(batch.column(f), -1).to_numpy(zero_copy_only=False)
                        for f in PIECE_FIELDS], axis=1)
        rank = batch.column("rank").to_numpy()
        for k, rows in _rows_by_key(key).items():
            if k not in sinks:
                sink = pa.BufferOutputStream()
                sinks[k] = (sink, pa.ipc.new_stream(sink, batch.schema, options=options))
            sinks[k][1].write_batch(batch.take(pa.array(rows)))
            events[k] = events.get(k, 0) + int(weight[rank[rows]].sum())
    streams = {}
    for k, (sink, writer) in sinks.items():
        writer.close()
        streams[k] = sink.getvalue()
    return Pieces(path, meta, streams, events)


def _row_weights(meta: StoreMeta) -> np.ndarray:
    """Per stored rank, the ranks its rows stand for (1 in a full store)."""
    weight = np.ones(meta.world_size, np.int64)
    for rep, ranks in (meta.stand_ins.members.items() if meta.stand_ins else ()):
        weight[rep] = len(ranks)
    return weight


def _rows_by_key(key: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
    """Row indices of each distinct row of ``key`` (two columns of ints >= -1,
    in order within each): one stable sort of one int64 key."""
    high, low = key[:, 0].astype(np.int64) + 1, key[:, 1].astype(np.int64) + 1
    flat = high * (int(low.max(initial=0)) + 1) + low
    order = np.argsort(flat, kind="stable")
    cuts = np.r_[0, np.flatnonzero(np.diff(flat[order])) + 1, len(order)]
    return {(int(key[order[a], 0]), int(key[order[a], 1])): order[a:b]
            for a, b in zip(cuts[:-1], cuts[1:]) if b > a}


def _empty_table(path: Path) -> pa.Table:
    dataset = ds.dataset(gate.checked(path, ""), format="parquet")
    schema = pa.schema([f for f in dataset.schema if f.name != "args"] + [pa.field(_ROW, pa.int64())])
    return schema.empty_table()
