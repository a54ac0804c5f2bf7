"""Chrome trace JSON written from event columns, streaming, for a selection.

A run keeps every event in ``trace.parquet``; a browser opens a Chrome trace
of a few hundred thousand events at most. ``export-trace`` writes the ranks
and iterations asked for, one batch at a time, in the Trace Event Format
(complete ``X`` events in µs, one process per rank, one thread per kind:
compute, p2p, collective), on the aligned clock or each rank's own.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, TextIO

import numpy as np

from .columns import INT_FIELDS, KINDS, ROLES, EventColumns
from ..errors import UserError
from ..parallel.ops import OP_KINDS
from .events import LANES

BROWSER_EVENTS = 200_000  # above this a run writes no trace.json of its own (see export-trace)


Ranges = list[tuple[int, int]]  # (first, last) pairs, inclusive, as given


def parse_ranges(text: str | None, option: str) -> Ranges | None:
    """``"0-7,12"`` -> [(0, 7), (12, 12)], nothing expanded; None selects everything."""
    if text is None:
        return None
    out = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise UserError(f"{option}: expected numbers and ranges like 0-7,12, got "
                            f"{text!r:.80}") from None
        if first < 0 or last < first:
            raise UserError(f"{option}: {part.strip()!r:.80} is not a range of non-negative "
                            "numbers")
        out.append((first, last))
    return out


def select(ranges: Ranges | None, option: str, bound: int, clip: bool = False
           ) -> tuple[list[int] | None, str | None]:
    """The numbers ``ranges`` select below ``bound`` (what exists), and a note when
    some were left out (``clip``); without ``clip`` a number past ``bound`` is
    refused. Checked on the ranges, so memory is bounded by ``bound``."""
    if ranges is None:
        return None, None
    top = max(last for _, last in ranges)
    if top >= bound and not clip:
        raise UserError(f"{option}: {top} is out of range 0..{bound - 1}" if bound else
                        f"{option}: there is nothing to select")
    kept = sorted({n for first, last in ranges for n in range(first, min(last, bound - 1) + 1)})
    note = (f"{option}: the run has 0..{bound - 1}; selected {len(kept):,} of them"
            if top >= bound else None)
    return kept, note


def parse_selection(text: str | None, option: str, bound: int) -> list[int] | None:
    """``"0-7,12"`` -> [0, ..., 7, 12] below ``bound`` (else refused); None: everything."""
    return select(parse_ranges(text, option), option, bound)[0]


def _args_text(cols: EventColumns, group_text: list[str]) -> list[str]:
    """Each row's args object as JSON text (the same keys a backend records)."""
    fields: list[tuple[str, np.ndarray]] = [(f, getattr(cols, f)) for f in INT_FIELDS]
    fields += [("bytes", cols.nbytes), ("peer", cols.peer), ("tag", cols.tag)]
    lists = [(k, v.tolist()) for k, v in fields]
    groups = cols.group.tolist()
    kind_text = [f'"kind":"{k}"' for k in OP_KINDS]
    role_text = [f'"role":"{r}"' for r in ROLES]
    kinds, roles = cols.kind.tolist(), cols.role.tolist()
    extra = cols.extra.tolist() if cols.extra is not None else None
    out = []
    for i in range(len(cols)):
        parts = [f'"{k}":{v[i]}' for k, v in lists if v[i] >= 0]
        if kinds[i] < len(kind_text):
            parts.append(kind_text[kinds[i]])
        if roles[i] >= 0:
            parts.append(role_text[roles[i]])
        if groups[i] >= 0:
            parts.append(f'"group":{group_text[groups[i]]}')
        if extra is not None and extra[i] is not None:
            parts += [f"{json.dumps(k)}:{json.dumps(v)}" for k, v in json.loads(extra[i]).items()]
        out.append("{" + ",".join(parts) + "}")
    return out


def chrome_rows(cols: EventColumns) -> Iterable[str]:
    """One JSON object per event, times in µs (rounded to ns)."""
    names = [json.dumps(n) for n in cols.names]
    group_text = [json.dumps(list(g)) for g in cols.groups]
    kinds = [KINDS[k] for k in range(len(KINDS))]
    ts = np.round(cols.start_s * 1e6, 3).tolist()
    dur = np.round(cols.dur_s * 1e6, 3).tolist()
    rank, name, kind = cols.rank.tolist(), cols.name.tolist(), cols.kind.tolist()
    args = _args_text(cols, group_text)
    for i in range(len(cols)):
        k = kinds[kind[i]]
        yield (f'{{"ph":"X","name":{names[name[i]]},"cat":"{k}","pid":{rank[i]},'
               f'"tid":{LANES.get(k, 0)},"ts":{ts[i]!r},"dur":{dur[i]!r},"args":{args[i]}}}')


def _process_rows(rank: int, label: str) -> Iterable[str]:
    yield json.dumps({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                      "args": {"name": label}})
    yield json.dumps({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                      "args": {"sort_index": rank}})
    for lane, tid in LANES.items():
        yield json.dumps({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                          "args": {"name": lane}})


def write_chrome(path: Path, batches: Iterable[EventColumns], label: Callable[[int], str],
                 metadata: dict[str, Any]) -> int:
    """Stream ``batches`` into one Chrome trace file; returns events written
    (callers that replace a file write a temporary one: ``files.atomic_file``)."""
    count = 0
    with open(path, "w") as fh:
        fh.write('{"traceEvents":[\n')
        first = True
        seen: set[int] = set()
        for cols in batches:
            for rank in np.unique(cols.rank).tolist():
                if rank not in seen:
                    seen.add(rank)
                    first = _write_rows(fh, _process_rows(rank, label(rank)), first)
            first = _write_rows(fh, chrome_rows(cols), first)
            count += len(cols)
        fh.write('\n],"displayTimeUnit":"ms","metadata":')
        fh.write(json.dumps(metadata, allow_nan=False) + "}\n")
    return count


def _write_rows(fh: TextIO, rows: Iterable[str], first: bool) -> bool:
    for row in rows:
        fh.write(row if first else ",\n" + row)
        first = False
    return first
