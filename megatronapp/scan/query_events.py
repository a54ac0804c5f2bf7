"""The ``events`` table of ``megatronapp query``, built from a trace's columns.

No object per event: the aligned columns and their sync ops (``ScanInput``)
go into DuckDB as typed columns (``events_rows``), beside small tables of
names, groups and sync-op keys; the view ``events`` spells a row out as it is
read: name, kind, group_ranks (the group's ranks as text), related_sync_op
(the op's id as ``deps.reconstruct`` names it: ``coll[0,1]#3``,
``p2p[0->1:5]#2``) and args (JSON of the event's arguments, nulls left out).
A query that reads a few columns (``count(*)``) never builds the text of the
others.
"""
from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pyarrow as pa

from megatronapp.trace.columns import INT_FIELDS, KINDS, ROLES, EventColumns
from megatronapp.trace.metrics import group_ids, nth_in_group
from megatronapp.parallel.ops import OP_KINDS

from megatronapp.scan.align.inputs import ScanInput
from megatronapp.scan.align.table import COLLECTIVE, COLLECTIVE_KIND, SyncTable

ROWS, NAMES, GROUPS, OP_KEYS, EXTRA = ("events_rows", "events_names", "events_groups",
                                      "events_op_keys", "events_extra")
NO_OP, P2P = -1, 1
BATCH_ROWS = 1 << 18  # rows moved into DuckDB at a time


def group_id_text(group: tuple[int, ...]) -> str:
    """A collective's group as ``deps`` writes it in an op id (canonical order)."""
    g = sorted(group)
    if len(g) <= 8:
        return ",".join(map(str, g))
    return f"{g[0]}..{g[-1]}/{len(g)}:{zlib.crc32(repr(tuple(g)).encode()):08x}"


class OpKeys:
    """Per row, the sync op it belongs to as ``(kind, key, n)``: kind COLLECTIVE,
    P2P or NO_OP, key an id into ``texts`` (``0,1`` or ``0->1:5``), n the op's
    place among the ops of that key."""

    def __init__(self, cols: EventColumns, sync: SyncTable):
        n = len(cols)
        self.kind = np.full(n, NO_OP, np.int8)
        self.key = np.full(n, -1, np.int32)
        self.n = np.full(n, -1, np.int64)
        self.texts: dict[str, int] = {}
        self._collectives(cols)
        self._p2p(cols, sync)

    def _text_ids(self, texts: list[str]) -> np.ndarray:
        return np.array([self.texts.setdefault(t, len(self.texts)) for t in texts] + [-1],
                        np.int32)

    def _collectives(self, cols: EventColumns) -> None:
        """Every collective with a group is a member: the n-th call a rank makes
        on a group (in row order) is the group's n-th op."""
        canon: dict[tuple[int, ...], int] = {}
        canonical = np.array([canon.setdefault(tuple(sorted(g)), len(canon))
                              for g in cols.groups] + [-1], np.int64)[cols.group.astype(np.int64)]
        rows = np.flatnonzero((canonical >= 0) & (cols.kind == COLLECTIVE_KIND))
        if not len(rows):
            return
        text_of = self._text_ids([group_id_text(g) for g in canon])
        self.kind[rows] = COLLECTIVE
        self.key[rows] = text_of[canonical[rows]]
        self.n[rows] = nth_in_group(group_ids(cols.rank[rows].astype(np.int64),
                                              canonical[rows])[0])

    def _p2p(self, cols: EventColumns, sync: SyncTable) -> None:
        """A matched send and receive: keyed by sender, receiver and the send's
        stream (its recorded tag, else the direction its name gives), numbered
        in (iteration, microbatch, issue) order among the sends of that key."""
        p2p = np.flatnonzero(sync.op_kind != COLLECTIVE)
        send, recv = sync.sender[p2p], sync.receiver[p2p]
        if not len(send):
            return
        streams = [_stream(cols, int(s)) for s in send]
        texts = [f"{cols.rank[s]}->{cols.rank[r]}:{st}" for s, r, st in
                 zip(send.tolist(), recv.tolist(), streams)]
        key = self._text_ids(texts)[:-1]
        n = nth_in_group(key.astype(np.int64), [cols.iteration[send].astype(np.int64),
                                                cols.microbatch[send].astype(np.int64)])
        for rows in (send, recv):
            self.kind[rows], self.key[rows], self.n[rows] = P2P, key, n


def _stream(cols: EventColumns, row: int) -> str:
    """``kinds.p2p_side``'s stream of a send, as its op id shows it."""
    if cols.role[row] >= 0:
        return str(int(cols.tag[row])) if cols.tag[row] >= 0 else "None"
    lowered = cols.names[cols.name[row]].lower()
    return lowered.replace("send", "", 1).strip("_")


def _nullable(values: np.ndarray) -> pa.Array:
    return pa.array(values, mask=values < 0)


def extra_ids(extra: np.ndarray | None, n: int) -> tuple[np.ndarray, list[str]]:
    """Each row's other args as an id into the distinct texts (-1: none); a
    run repeats a few texts over millions of rows."""
    if extra is None:
        return np.full(n, -1, np.int32), []
    ids: dict[str, int] = {}
    codes = np.fromiter((-1 if x is None else ids.setdefault(x, len(ids)) for x in extra),
                        np.int32, count=n)
    return codes, list(ids)


def _batch(cols: EventColumns, keys: OpKeys, extra: np.ndarray, lo: int, hi: int
           ) -> pa.RecordBatch:
    part = slice(lo, hi)
    start, dur = cols.start_s[part], cols.dur_s[part]
    arrays: dict[str, Any] = {
        "rank": pa.array(cols.rank[part]), "name_id": pa.array(cols.name[part]),
        "kind_id": pa.array(cols.kind[part]), "start_us": pa.array(start * 1e6),
        "dur_us": pa.array(dur * 1e6), "end_us": pa.array((start + dur) * 1e6),
        **{f: _nullable(getattr(cols, f)[part]) for f in INT_FIELDS},
        "nbytes": _nullable(cols.nbytes[part]), "peer": _nullable(cols.peer[part]),
        "group_id": _nullable(cols.group[part]), "role": _nullable(cols.role[part]),
        "tag": _nullable(cols.tag[part]),
        "extra_id": _nullable(extra[part]),
        "op_kind": _nullable(keys.kind[part]), "op_key": _nullable(keys.key[part]),
        "op_n": _nullable(keys.n[part])}
    return pa.RecordBatch.from_pydict(arrays)


def _small_tables(con: Any, cols: EventColumns, keys: OpKeys, extras: list[str]) -> None:
    con.register("extra_arrow", pa.table({"id": np.arange(len(extras), dtype=np.int32),
                                          "text": pa.array(extras, pa.string())}))
    con.execute(f"CREATE TABLE {EXTRA} AS SELECT * FROM extra_arrow")
    con.register("names_arrow", pa.table({"id": np.arange(len(cols.names), dtype=np.int16),
                                          "name": list(cols.names)}))
    con.execute(f"CREATE TABLE {NAMES} AS SELECT * FROM names_arrow")
    con.register("groups_arrow", pa.table({
        "id": np.arange(len(cols.groups), dtype=np.int32),
        "ranks": pa.array([list(g) for g in cols.groups], pa.list_(pa.int64())),
        "text": [",".join(map(str, g)) for g in cols.groups]}))
    con.execute(f"CREATE TABLE {GROUPS} AS SELECT * FROM groups_arrow")
    con.register("keys_arrow", pa.table({"id": np.arange(len(keys.texts), dtype=np.int32),
                                         "text": list(keys.texts)}))
    con.execute(f"CREATE TABLE {OP_KEYS} AS SELECT * FROM keys_arrow")
    for name in ("extra_arrow", "names_arrow", "groups_arrow", "keys_arrow"):
        con.unregister(name)


def _literal_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join("'" + v.replace("'", "''") + "'" for v in values) + "]"


def _view_sql() -> str:
    """The ``events`` view: a row of ``events_rows`` spelled out."""
    kinds, roles = _literal_list(KINDS), _literal_list(ROLES)
    classified = len(OP_KINDS)  # kinds below this are recorded ones (args carry them)
    return f"""CREATE VIEW events AS
        SELECT r.rank, n.name, {kinds}[r.kind_id + 1] AS kind, r.start_us, r.dur_us, r.end_us,
               r.iteration, r.microbatch, r.chunk,
               coalesce(r.nbytes::DOUBLE, TRY_CAST(json_extract(x.text, '$.bytes') AS DOUBLE))
                   AS bytes,
               r.peer, g.text AS group_ranks,
               CASE r.op_kind WHEN 0 THEN 'coll[' || k.text || ']#' || r.op_n
                              WHEN 1 THEN 'p2p[' || k.text || ']#' || r.op_n END
                   AS related_sync_op,
               json_merge_patch(json_merge_patch(json_merge_patch('{{}}', json_object(
                   'iteration', r.iteration, 'microbatch', r.microbatch, 'chunk', r.chunk,
                   'kind', CASE WHEN r.kind_id < {classified} THEN {kinds}[r.kind_id + 1] END,
                   'bytes', r.nbytes, 'peer', r.peer, 'group', g.ranks,
                   'role', {roles}[r.role + 1], 'tag', r.tag)), coalesce(x.text, '{{}}')),
                   json_object('related_sync_op', CASE r.op_kind
                       WHEN 0 THEN 'coll[' || k.text || ']#' || r.op_n
                       WHEN 1 THEN 'p2p[' || k.text || ']#' || r.op_n END))::VARCHAR AS args
        FROM {ROWS} r
        LEFT JOIN {NAMES} n ON n.id = r.name_id
        LEFT JOIN {GROUPS} g ON g.id = r.group_id
        LEFT JOIN {OP_KEYS} k ON k.id = r.op_key
        LEFT JOIN {EXTRA} x ON x.id = r.extra_id"""


def load_events(con: Any, scan: ScanInput) -> None:
    """The ``events`` view of ``scan`` on ``con``, its rows moved a batch at a time."""
    cols = scan.cols
    keys = OpKeys(cols, scan.sync)
    extra, extras = extra_ids(cols.extra, len(cols))
    _small_tables(con, cols, keys, extras)
    for lo in range(0, max(len(cols), 1), BATCH_ROWS):
        batch = pa.Table.from_batches([_batch(cols, keys, extra, lo,
                                              min(len(cols), lo + BATCH_ROWS))])
        con.register("rows_arrow", batch)
        con.execute(f"CREATE TABLE {ROWS} AS SELECT * FROM rows_arrow" if lo == 0
                    else f"INSERT INTO {ROWS} SELECT * FROM rows_arrow")
        con.unregister("rows_arrow")
    con.execute(_view_sql())
