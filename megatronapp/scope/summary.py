"""Readable summaries of a capture, and SQL over it (DuckDB, no file access).

``query`` registers the capture's tables from Python (``stats`` from
stats.parquet, ``raw_index`` and ``injections`` from their JSON) on a DuckDB
connection whose external access is off: SQL reads these tables and nothing
else on the machine.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from ..errors import UserError
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


def connect(capture: Capture) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(config={"enable_external_access": False})
    con.register("stats", capture.stats())
    raw = [{k: str(v) if isinstance(v, list) else v for k, v in e.items()}
           for e in capture.raw_index()]
    con.register("raw_index", _table(raw, {"name": None}))
    inj = [{k: str(v) if isinstance(v, (list, dict)) else v for k, v in e.items()}
           for e in capture.injections()]
    con.register("injections", _table(inj, {"kind": None}))
    return con


def query(path: str | Path, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    con = connect(Capture(path))
    try:
        cur = con.execute(sql)
    except duckdb.Error as err:
        raise UserError(f"SQL: {str(err).splitlines()[0]}") from None
    try:
        names = [d[0] for d in cur.description] if cur.description else []
        return names, cur.fetchall()
    finally:
        con.close()


def summary_lines(path: str | Path) -> list[str]:
    from ..scan.query import format_rows

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
    con = connect(capture)
    try:
        cur = con.execute(OVERVIEW_SQL)
        names = [d[0] for d in cur.description]
        lines += ["", format_rows(names, cur.fetchall())]
        if m["injections"]:
            cur = con.execute("SELECT kind, count(*) AS injections, min(step) AS first_step, "
                              "max(step) AS last_step FROM injections GROUP BY kind ORDER BY kind")
            lines += ["", format_rows([d[0] for d in cur.description], cur.fetchall())]
    finally:
        con.close()
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
