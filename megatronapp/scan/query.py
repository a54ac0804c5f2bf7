"""SQL over trace events with DuckDB (the paper used Perfetto SQL for this).

One table, ``events``: rank, name, kind (compute | p2p | collective | other), start_us,
dur_us, end_us, iteration, microbatch, chunk, bytes, peer, group_ranks (text),
related_sync_op, args (JSON text).
"""
from __future__ import annotations

import csv
import json
import tempfile
from pathlib import Path
from typing import Any

import duckdb

from megatronapp.kinds import event_kind

from .load import RankEvents

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


def connect(events: RankEvents) -> duckdb.DuckDBPyConnection:
    """An in-memory database holding the ``events`` table."""
    con = duckdb.connect()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "events.csv"
        with open(path, "w", newline="") as fh:
            w = csv.writer(fh)
            for rank in sorted(events):
                w.writerows(_row(rank, e) for e in events[rank])
        columns = ", ".join(f"'{k}': '{v}'" for k, v in COLUMNS.items())
        con.execute(f"CREATE TABLE events AS SELECT * FROM read_csv('{path}', header=false, "
                    f"columns={{{columns}}}, nullstr='')")
    return con


def run_query(events: RankEvents, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    con = connect(events)
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
