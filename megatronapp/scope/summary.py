"""Readable summaries of a capture, and SQL over it (DuckDB, no file access).

``connect`` registers the capture's tables from Python (``stats`` from
stats.parquet, ``raw_index`` and ``injections`` from their JSON) on the same
locked, memory-limited DuckDB connection as ``megatronapp query`` (external
access off, its own temporary directory): SQL reads these tables and nothing
else on the machine.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ContextManager

import duckdb
import pyarrow as pa

from ..scan.query import QueryLimits, Rows, answer, format_rows, sandboxed
from ..scan.query_options import Output
from .storage import Capture

OVERVIEW_SQL = """
SELECT site, layer, stat, count(*) AS rows, count(DISTINCT step) AS steps,
       avg(value) FILTER (WHERE NOT isnan(value)) AS mean,
       min(value) FILTER (WHERE NOT isnan(value)) AS min,
       max(value) FILTER (WHERE NOT isnan(value)) AS max,
       sum(CASE WHEN isnan(value) THEN 1 ELSE 0 END) AS nan_rows
FROM stats GROUP BY site, layer, stat ORDER BY layer, site, stat
"""


def _table(rows: list[dict[str, Any]], default: dict[str, Any]) -> pa.Table:
    return pa.Table.from_pylist(rows) if rows else pa.Table.from_pylist([default])


def connect(capture: Capture,
            limits: QueryLimits = QueryLimits()) -> ContextManager[duckdb.DuckDBPyConnection]:
    """The capture's tables on a sandboxed connection (loaded first, then locked)."""
    def load(con: duckdb.DuckDBPyConnection, _scratch: Path) -> None:
        con.register("stats", capture.stats())
        raw = [{k: str(v) if isinstance(v, list) else v for k, v in e.items()}
               for e in capture.raw_index()]
        con.register("raw_index", _table(raw, {"name": None}))
        inj = [{k: str(v) if isinstance(v, (list, dict)) else v for k, v in e.items()}
               for e in capture.injections()]
        con.register("injections", _table(inj, {"kind": None}))
    return sandboxed(load, limits)


def query(path: str | Path, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    """The column names and first rows of ``sql`` over the capture at ``path``."""
    rows = answer(connect(Capture(path)), sql, Output(), Path(path))
    assert isinstance(rows, Rows)  # no --out: rows come back
    return rows.names, rows.rows


def summary_lines(path: str | Path) -> list[str]:
    capture = Capture(path)
    m = capture.manifest
    model = m.get("model", {})
    lines = [f"{capture.path}: {m.get('source')} capture of {m.get('scenario')!r} "
             f"({model.get('layers')} layers, hidden {model.get('hidden')}, "
             f"{model.get('heads')} heads)",
             f"  {m['rows']} statistic rows, {m['raw_tensors']} raw tensors, "
             f"{m['injections']} injections, {m['dropped_records']} records dropped "
             f"(writer behind), {m.get('incomplete_rows', 0)} rows missing a TP slice"]
    lines += [f"  note: {n}" for n in m.get("notes", [])]
    with connect(capture) as con:
        cur = con.execute(OVERVIEW_SQL)
        names = [d[0] for d in cur.description]
        lines += ["", format_rows(names, cur.fetchall())]
        if m["injections"]:
            cur = con.execute("SELECT kind, count(*) AS injections, min(step) AS first_step, "
                              "max(step) AS last_step FROM injections GROUP BY kind ORDER BY kind")
            lines += ["", format_rows([d[0] for d in cur.description], cur.fetchall())]
    return lines


def run_lines(scope: dict[str, Any], out: Path) -> list[str]:
    """What ``megatronapp run`` prints about MegaScope."""
    lines = []
    if "predicted_capture_overhead" in scope:
        lines.append(f"  scope: predicted capture overhead {100 * scope['predicted_capture_overhead']:.2f}% "
                     f"of iteration time ({scope['capture_events']} scope_capture events)")
    if "capture_dir" in scope:
        lines.append(f"  scope: {scope['rows']} statistic rows, {scope['raw_tensors']} raw tensors, "
                     f"{scope['injections']} injections, {scope['dropped_records']} records "
                     f"dropped; capture in {out / scope['capture_dir']}")
    return lines
