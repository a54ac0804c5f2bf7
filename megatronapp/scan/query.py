"""SQL over trace events with DuckDB (the paper used Perfetto SQL for this).

One table, ``events``: rank, name, kind (compute | p2p | collective | other), start_us,
dur_us, end_us, iteration, microbatch, chunk, bytes, peer, group_ranks (text),
related_sync_op, args (JSON text).

By default the query sees that table and nothing else: once it is loaded,
external access (files, ATTACH, COPY ... TO, extensions) is switched off, a
memory limit is set and the configuration is locked so SQL cannot undo either.
"""
from __future__ import annotations

import csv
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from megatronapp.errors import UserError
from megatronapp.kinds import event_kind
from megatronapp.limits import available_memory

from .load import RankEvents

MAX_DEFAULT_MEMORY = 4e9  # bytes: the default limit is a quarter of what is free, at most this


@dataclass(frozen=True)
class QueryLimits:
    """What SQL may do: external access is an explicit choice."""

    external_access: bool = False
    memory_limit: str | None = None  # DuckDB size text ("2GB"); None: the default

    def memory_setting(self) -> str:
        if self.memory_limit is not None:
            return self.memory_limit
        mb = max(64.0, min(MAX_DEFAULT_MEMORY, available_memory() / 4) / 1e6)
        return f"{int(mb)}MB"


COLUMNS = {"rank": "INTEGER", "name": "VARCHAR", "kind": "VARCHAR", "start_us": "DOUBLE",
           "dur_us": "DOUBLE", "end_us": "DOUBLE", "iteration": "INTEGER", "microbatch": "INTEGER",
           "chunk": "INTEGER", "bytes": "DOUBLE", "peer": "INTEGER", "group_ranks": "VARCHAR",
           "related_sync_op": "VARCHAR", "args": "VARCHAR"}


def _row(rank: int, e: Any) -> list[Any]:
    a = e.args
    group = a.get("group")
    return [rank, e.name, event_kind(e.name, a), e.start_s * 1e6, e.dur_s * 1e6, e.end_s * 1e6,
            a.get("iteration"), a.get("microbatch"), a.get("chunk"), a.get("bytes"), a.get("peer"),
            ",".join(map(str, group)) if isinstance(group, list) else None,
            a.get("related_sync_op"), json.dumps(dict(a), default=str)]


def connect(events: RankEvents, limits: QueryLimits = QueryLimits()) -> duckdb.DuckDBPyConnection:
    """An in-memory database holding the ``events`` table, locked down by ``limits``."""
    con = duckdb.connect(config={"autoinstall_known_extensions": False,
                                 "autoload_known_extensions": False})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "events.csv"
        with open(path, "w", newline="") as fh:
            w = csv.writer(fh)
            for rank in sorted(events):
                w.writerows(_row(rank, e) for e in events[rank])
        columns = ", ".join(f"'{k}': '{v}'" for k, v in COLUMNS.items())
        con.execute(f"CREATE TABLE events AS SELECT * FROM read_csv('{path}', header=false, "
                    f"columns={{{columns}}}, nullstr='')")
    try:
        con.execute("SET memory_limit = ?", [limits.memory_setting()])
    except duckdb.Error as err:
        con.close()
        raise UserError(f"--memory-limit: {str(err).splitlines()[0]}") from None
    if not limits.external_access:
        con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def run_query(events: RankEvents, sql: str,
              limits: QueryLimits = QueryLimits()) -> tuple[list[str], list[tuple[Any, ...]]]:
    con = connect(events, limits)
    try:
        cur = con.execute(sql)
        names = [d[0] for d in cur.description] if cur.description else []
        return names, cur.fetchall()
    finally:
        con.close()


def format_rows(names: list[str], rows: list[tuple[Any, ...]]) -> str:
    cells = [names] + [["NULL" if v is None else (f"{v:.6g}" if isinstance(v, float) else str(v))
                        for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(names))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)
