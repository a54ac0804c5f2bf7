"""Following a capture while a run writes it.

A run's ranks write self-contained part files under ``CAPTURE/parts/rank{r}/``
(``stats-*.parquet`` and, for tensor-parallel slices, ``partials-*.parquet``),
each renamed into place only when complete; at the end the run merges them
into ``stats.parquet`` + ``manifest.json`` and removes ``parts/``.
``PartsFollower.poll`` reads only the part files it has not read yet (the
partials again whenever one is added, since their slices combine across
files), and switches to the merged capture once its manifest appears.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..storage import PARTIAL_SCHEMA, STATS_SCHEMA, Capture, merge_partials


@dataclass(frozen=True)
class Snapshot:
    """Everything read so far: the statistics and what the manifest would say."""

    stats: pa.Table
    manifest: dict[str, Any]


@dataclass
class PartsFollower:
    root: Path  # the capture directory
    _stats: dict[Path, pa.Table] = field(default_factory=dict)
    _partials: frozenset[Path] = frozenset()
    _merged: pa.Table | None = None
    _merged_mtime: float | None = None

    def poll(self) -> Snapshot | None:
        """What changed since the last poll, or ``None`` when nothing did."""
        try:
            if (self.root / "manifest.json").is_file():
                return self._poll_merged()
            return self._poll_parts()
        except FileNotFoundError:  # the run merged its parts between listing and reading
            return None

    def _poll_merged(self) -> Snapshot | None:
        mtime = (self.root / "manifest.json").stat().st_mtime
        if mtime == self._merged_mtime:
            return None
        capture = Capture(self.root)
        self._merged_mtime = mtime
        return Snapshot(capture.stats(), {**capture.manifest, "following": "merged capture"})

    def _poll_parts(self) -> Snapshot | None:
        parts = self.root / "parts"
        new = [f for f in sorted(parts.glob("rank*/stats-*.parquet")) if f not in self._stats]
        partials = frozenset(parts.glob("rank*/partials-*.parquet"))
        if not new and partials == self._partials:
            return None
        for f in new:
            self._stats[f] = pq.read_table(f, schema=STATS_SCHEMA)
        if partials != self._partials:
            tables = [pq.read_table(f, schema=PARTIAL_SCHEMA) for f in sorted(partials)]
            self._merged = merge_partials(pa.concat_tables(tables))[0] if tables else None
            self._partials = partials
        tables = [*self._stats.values(), *([self._merged] if self._merged is not None else [])]
        stats = pa.concat_tables(tables) if tables else STATS_SCHEMA.empty_table()
        return Snapshot(stats, {"source": "followed run (parts being written)",
                                "rows": stats.num_rows, "dropped_records": _dropped(parts),
                                "following": "parts"})


def _dropped(parts: Path) -> int:
    """Drops the ranks that have finished report (a rank writes its counters last)."""
    total = 0
    for f in parts.glob("rank*/counters.json"):
        try:
            total += int(json.loads(f.read_text()).get("dropped", 0))
        except (OSError, ValueError):
            pass
    return total
