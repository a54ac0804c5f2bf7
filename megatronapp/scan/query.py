"""SQL over trace events with DuckDB (the paper used Perfetto SQL for this).

One table, ``events``: rank, name, kind (compute | p2p | collective | other), start_us,
dur_us, end_us, iteration, microbatch, chunk, bytes, peer, group_ranks (text),
related_sync_op, args (JSON text).

By default the query sees that table and nothing else: once it is loaded,
external access (files, ATTACH, COPY ... TO, extensions) is switched off, a
memory limit is set and the configuration is locked so SQL cannot undo either.
DuckDB spills into a temporary directory of its own, removed afterwards. The
query runs on a worker thread so that a stop signal interrupts it, and its
result streams: the terminal gets at most ``--max-rows`` rows, ``--out`` gets
every row, written a batch at a time.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, ContextManager, Iterator, TypeVar

import annotated_types
import duckdb

from megatronapp.errors import UserError
from megatronapp.io.outdirs import new_file, scratch_folder
from megatronapp.host.limits import DEFAULT_MAX_SECONDS, available_memory, free_disk

from megatronapp.scan.align.inputs import ScanInput, prepare
from megatronapp.scan.ingest.load import RankEvents
from megatronapp.scan.query_events import load_events
from megatronapp.scan.query_options import Output

MAX_DEFAULT_MEMORY = 4e9  # bytes: the default limit is a quarter of what is free, at most this
FETCH_ROWS = 2048  # rows per fetch from DuckDB's streamed result
# Rows are held only while this much memory stays free: reporting that they do
# not fit, and the threads the runtime starts meanwhile, need some of it (past
# an address-space cap a new thread aborts the process instead).
ROWS_HEADROOM_BYTES = 256 * 2**20
CHECK_EVERY_CHUNKS = 16
BATCH_ROWS = 65_536  # rows per Arrow batch written to --out
WAIT_SECONDS = 0.1  # how long the main thread sleeps between looks at the query
OUT_KINDS = {".parquet": "parquet", ".csv": "csv"}


MAX_SPILL_BYTES = 4e9  # DuckDB's private temporary folder: half the free disk, at most this


@dataclass(frozen=True)
class QueryLimits:
    """What SQL may do: external access is an explicit choice; its time is
    bounded by ``max_seconds`` (None: no bound, ``--no-limits``)."""

    external_access: bool = False
    memory_limit: str | None = None  # DuckDB size text ("2GB"); None: the default
    max_seconds: float | None = DEFAULT_MAX_SECONDS

    @classmethod
    def of(cls, args: argparse.Namespace, external_access: bool = False) -> "QueryLimits":
        return cls(external_access, args.memory_limit,
                   None if args.no_limits else args.max_seconds)

    def memory_setting(self) -> str:
        if self.memory_limit is not None:
            return self.memory_limit
        mb = max(64.0, min(MAX_DEFAULT_MEMORY, available_memory() / 4) / 1e6)
        return f"{int(mb)}MB"


def _spill_setting(scratch: Path) -> str:
    """What DuckDB may write into its private folder: half the free disk there, capped."""
    free = free_disk(scratch) or 0.0
    return f"{int(max(64e6, min(MAX_SPILL_BYTES, free / 2)) / 1e6)}MB"


def read_only(sql: str) -> None:
    """Refuse anything but exactly one SELECT (DuckDB's own parser says what
    each statement is): no second statement, PREPARE/EXECUTE, COPY, ATTACH,
    INSTALL/LOAD, PRAGMA, SET, EXPORT, CREATE or any other that writes."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as err:
        raise UserError(f"SQL: {str(err).splitlines()[0]}") from None
    if not statements:
        raise UserError("SQL: empty query (e.g. \"SELECT rank, sum(dur_us) FROM events GROUP BY "
                        "rank\")")
    if len(statements) > 1:
        raise UserError(f"SQL: {len(statements)} statements; a query is exactly one SELECT")
    kind = statements[0].type
    if kind != duckdb.StatementType.SELECT:
        raise UserError(f"SQL: a {kind.name} statement is refused; a query is exactly one "
                        "read-only SELECT")


Loader = Callable[[duckdb.DuckDBPyConnection, Path], None]


def scan_loader(scan: ScanInput) -> Loader:
    """Loads the ``events`` view of an aligned, linked trace (``query_events``)."""
    return lambda con, _scratch: load_events(con, scan)


@contextmanager
def sandboxed(load: Loader,
              limits: QueryLimits = QueryLimits()) -> Iterator[duckdb.DuckDBPyConnection]:
    """An in-memory database filled by ``load``, then locked down by ``limits``.

    DuckDB spills to a directory of its own made here, not to its default
    ``./.tmp``: the one directory external access keeps allowed is its
    temporary directory, so with the default SQL could read and replace the
    user's files there. It is set before the lock, so SQL cannot move it."""
    with scratch_folder("megatronapp-duckdb-") as scratch:
        con = duckdb.connect(config={"autoinstall_known_extensions": False,
                                     "autoload_known_extensions": False,
                                     "temp_directory": str(scratch),
                                     "max_temp_directory_size": _spill_setting(scratch)})
        try:
            interruptible(con, lambda: load(con, scratch))  # a big trace loads for a while
            _lock(con, limits)
            yield con
        finally:
            con.close()


def _lock(con: duckdb.DuckDBPyConnection, limits: QueryLimits) -> None:
    try:
        con.execute("SET memory_limit = ?", [limits.memory_setting()])
    except duckdb.Error as err:
        raise UserError(f"--memory-limit: {str(err).splitlines()[0]}") from None
    if not limits.external_access:
        con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def connect_events(events: RankEvents,
                   limits: QueryLimits = QueryLimits()) -> ContextManager[duckdb.DuckDBPyConnection]:
    """The sandbox over ``events`` (aligned already)."""
    return sandboxed(scan_loader(prepare(events, aligned=True)), limits)


T = TypeVar("T")


class QueryTooLong(UserError):
    """SQL still running at ``--max-seconds``: stopped, one line."""

    # a duration, never NaN: its args must compare equal after a pickle round trip
    def __init__(self, seconds: Annotated[float, annotated_types.Ge(0)]):
        super().__init__(f"--max-seconds: the query ran for {seconds:g} s and was stopped "
                         "(raise --max-seconds, or pass --no-limits)")


def interruptible(con: duckdb.DuckDBPyConnection, work: Callable[[], T],
                  max_seconds: float | None = None) -> T:
    """``work()`` (which uses ``con``) on a worker thread while this thread waits,
    at most ``max_seconds`` (None: until it ends).

    A signal handler runs only between Python bytecodes of the main thread, never
    while it is inside DuckDB; waiting here in short joins lets a stop signal
    raise ``Interrupted`` at once, and DuckDB is then told to stop the query."""
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="duckdb-query") as pool:
        future = pool.submit(work)
        try:
            while True:
                try:
                    return future.result(timeout=WAIT_SECONDS)
                except FutureTimeout:
                    if deadline is not None and time.monotonic() > deadline:
                        raise QueryTooLong(max_seconds or 0.0) from None
        except BaseException:
            while not future.done():  # again until it stops: a query may start after the first
                con.interrupt()
                wait([future], timeout=WAIT_SECONDS)
            raise


@dataclass(frozen=True)
class Rows:
    """The first rows of a result, and whether it had more."""

    names: list[str]
    rows: list[tuple[Any, ...]]
    more: bool = False

    def cut_line(self) -> str:
        shown = len(self.rows)
        return (f"shown {shown:,} of at least {shown + 1:,} rows; pass --max-rows N or "
                f"--out FILE")


def first_rows(con: duckdb.DuckDBPyConnection, sql: str, max_rows: int) -> Rows:
    """At most ``max_rows`` rows, fetched a chunk at a time: DuckDB streams the
    result, so the rest are never made."""
    con.execute(sql)
    names = [d[0] for d in con.description] if con.description else []
    rows: list[tuple[Any, ...]] = []
    chunk: list[tuple[Any, ...]] = []
    try:
        while len(rows) <= max_rows and (chunk := con.fetchmany(min(FETCH_ROWS,
                                                                    max_rows + 1 - len(rows)))):
            rows.extend(chunk)
            if len(rows) % (CHECK_EVERY_CHUNKS * FETCH_ROWS) < len(chunk):
                _keep_headroom()
    except (MemoryError, duckdb.OutOfMemoryException) as err:
        held = bool(rows)
        # give the rows' memory back now: the error's traceback keeps this frame
        # (and so ``rows``) alive while the error is reported, which needs memory
        rows.clear()
        chunk = []
        if isinstance(err, duckdb.OutOfMemoryException) and not held:
            raise
        # the rows held so far took the memory, whichever allocator noticed first
        raise MemoryError from None
    return Rows(names, rows[:max_rows], len(rows) > max_rows)


def _keep_headroom() -> None:
    if available_memory() < ROWS_HEADROOM_BYTES:
        raise MemoryError


def write_rows(con: duckdb.DuckDBPyConnection, sql: str, path: Path, kind: str) -> int:
    """Every row into ``path`` (``kind`` parquet or csv), an Arrow batch at a time."""
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    reader = con.sql(sql).to_arrow_reader(BATCH_ROWS)
    written = 0
    with (pq.ParquetWriter(str(path), reader.schema) if kind == "parquet"
          else pcsv.CSVWriter(str(path), reader.schema)) as writer:
        for batch in reader:
            writer.write_batch(batch)
            written += batch.num_rows
    return written


@contextmanager
def sql_errors() -> Iterator[None]:
    """DuckDB's errors and running out of memory as one line each."""
    try:
        yield
    except duckdb.OutOfMemoryException as err:
        raise UserError(f"SQL: {str(err).splitlines()[0]}; pass a larger --memory-limit or "
                        f"ask for less") from None
    except duckdb.Error as err:
        raise UserError(f"SQL: {str(err).splitlines()[0]}") from None


@contextmanager
def python_memory() -> Iterator[None]:
    """Python running out of memory for the rows it holds, as one line."""
    try:
        yield
    except MemoryError:
        raise UserError("query: out of memory holding the rows; pass a smaller --max-rows or "
                        "--out FILE") from None


def run_query(events: RankEvents, sql: str, limits: QueryLimits = QueryLimits(),
              max_rows: int = Output.max_rows) -> Rows:
    read_only(sql)
    with connect_events(events, limits) as con:
        return interruptible(con, lambda: first_rows(con, sql, max_rows), limits.max_seconds)


def format_rows(names: list[str], rows: list[tuple[Any, ...]]) -> str:
    cells = [names] + [["NULL" if v is None else (f"{v:.6g}" if isinstance(v, float) else str(v))
                        for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(names))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)


# ------------------------------------------------- the query commands' output
def out_kind(out: Path, force: bool, inputs: Path) -> str:
    """The file format ``out`` names; refuses an existing file without ``force``
    and, even with it, a file of the inputs (``inputs`` itself or inside it)."""
    kind = OUT_KINDS.get(out.suffix.lower())
    if kind is None:
        raise UserError(f"--out: {out}: name a .parquet or .csv file")
    if out.exists() or out.is_symlink():
        target, source = out.resolve(), inputs.resolve()
        if target == source or source in target.parents:
            raise UserError(f"--out: {out} is one of the inputs ({inputs}); write elsewhere")
        if not force:
            raise UserError(f"--out: {out} exists; pass --force to replace it")
    return kind


def answer(connection: ContextManager[duckdb.DuckDBPyConnection], sql: str, output: Output,
           inputs: Path, max_seconds: float | None = None) -> Rows | int:
    """Run ``sql`` (one SELECT) on ``connection`` for at most ``max_seconds``: its
    first rows, or the number written to ``--out``."""
    read_only(sql)
    out = output.out
    kind = out_kind(out, output.force, inputs) if out is not None else ""
    with python_memory(), sql_errors(), connection as con:
        if out is None:
            return interruptible(con, lambda: first_rows(con, sql, output.max_rows), max_seconds)
        with new_file(out, "--out", output.force, [inputs]) as tmp:
            return interruptible(con, lambda: write_rows(con, sql, tmp, kind), max_seconds)


def show(result: Rows | int, output: Output) -> None:
    """Print what ``answer`` returned; a cut result says so on stderr."""
    if not isinstance(result, Rows):
        print(f"wrote {result:,} rows to {output.out}")
        return
    with python_memory():  # the whole text first: nothing is printed half
        text = (json.dumps([dict(zip(result.names, r)) for r in result.rows], default=str)
                if output.as_json else format_rows(result.names, result.rows))
    print(text)
    if result.more:
        print(result.cut_line(), file=sys.stderr)
