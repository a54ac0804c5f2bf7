"""Following a capture while a run writes it.

A run's ranks write self-contained part files under ``CAPTURE/parts/rank{r}/``
(``stats-*.parquet`` and, for tensor-parallel slices, ``partials-*.parquet``),
each renamed into place only when complete; at the end the run merges them
into ``stats.parquet`` + ``manifest.json`` and removes ``parts/``.
``megatronapp run --out RUN`` writes all this in a hidden sibling
(``outdirs.staged_siblings``) renamed to ``RUN`` when the run is done, so a
followed ``RUN`` is looked for in both, newest first, at every poll.
``PartsFollower.poll`` reads only the part files it has not read yet (the
partials again whenever one is added, since their slices combine across
files), and switches to the merged capture once its manifest appears.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ...errors import UserError
from ...io import gate
from ...io.outdirs import staged_siblings
from ...io.text import TextError
from ..storage import FORMAT, PARTIAL_SCHEMA, STATS_SCHEMA, Capture, merge_partials


def _is_capture_manifest(path: Path) -> bool:
    """A run directory has a manifest.json of its own (the files of the result)."""
    try:
        data = gate.read_json(path, "")
    except (OSError, TextError):  # absent, a FIFO, a device, not JSON: not a capture's
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def _written_at(capture: Path) -> float | None:
    """When the capture under ``capture`` last showed signs of life (None: none there)."""
    manifest = capture / "manifest.json"
    for marker in (manifest, capture / "parts"):
        if marker == manifest and not _is_capture_manifest(manifest):
            continue
        try:
            return marker.stat().st_mtime
        except FileNotFoundError:
            continue
    return None


def followed_capture(root: Path) -> Path | None:
    """The capture ``root`` names (a capture or a run directory), or the one a
    run writing ``root`` is filling now; the newest when both are there."""
    found = [(at, c) for base in (root, *staged_siblings(root)) for c in (base, base / "scope")
             if (at := _written_at(c)) is not None]
    return max(found)[1] if found else None


@dataclass(frozen=True)
class Snapshot:
    """Everything read so far: the statistics and what the manifest would say."""

    stats: pa.Table
    manifest: dict[str, Any]


@dataclass
class PartsFollower:
    target: Path  # the capture or run directory given
    root: Path | None = None  # where its capture is being read from now
    _stats: dict[Path, pa.Table] = field(default_factory=dict)
    _partials: frozenset[Path] = frozenset()
    _merged: pa.Table | None = None
    _merged_mtime: float | None = None

    def poll(self) -> Snapshot | None:
        """What changed since the last poll, or ``None`` when nothing did."""
        root = followed_capture(self.target)
        if root is None:
            return None
        if root != self.root:  # a new capture, or the run moved its directory into place
            self.root, self._stats, self._partials = root, {}, frozenset()
            self._merged, self._merged_mtime = None, None
        try:
            if (root / "manifest.json").is_file():
                return self._poll_merged(root)
            return self._poll_parts(root)
        except FileNotFoundError:  # the run merged or moved its parts while they were read
            return None

    def _poll_merged(self, root: Path) -> Snapshot | None:
        mtime = (root / "manifest.json").stat().st_mtime
        if mtime == self._merged_mtime:
            return None
        capture = Capture(root)
        self._merged_mtime = mtime
        return Snapshot(capture.stats(), {**capture.manifest, "capture_state": "merged"})

    def _poll_parts(self, root: Path) -> Snapshot | None:
        parts = root / "parts"
        new = [f for f in sorted(parts.glob("rank*/stats-*.parquet")) if f not in self._stats]
        partials = frozenset(parts.glob("rank*/partials-*.parquet"))
        if not new and partials == self._partials:
            return None
        for f in new:
            self._stats[f] = _part(f, STATS_SCHEMA)
        if partials != self._partials:
            tables = [_part(f, PARTIAL_SCHEMA) for f in sorted(partials)]
            self._merged = merge_partials(pa.concat_tables(tables))[0] if tables else None
            self._partials = partials
        tables = [*self._stats.values(), *([self._merged] if self._merged is not None else [])]
        stats = pa.concat_tables(tables) if tables else STATS_SCHEMA.empty_table()
        return Snapshot(stats, {"source": "followed run (parts being written)",
                                "rows": stats.num_rows, "dropped_records": _dropped(parts),
                                "capture_state": "parts"})


def _part(path: Path, schema: pa.Schema) -> pa.Table:
    """One part file; one that is not a regular file or not a part's Parquet is
    a ``UserError`` naming it (the view says so and goes on polling)."""
    try:
        return pq.read_table(gate.checked(path, ""), schema=schema)
    except gate.InputError as err:
        raise UserError(f"following: {err}") from None
    except (OSError, pa.ArrowException) as err:
        raise UserError(f"following: {path} is not a readable part file "
                        f"({str(err).splitlines()[0][:120]})") from None


def _dropped(parts: Path) -> int:
    """Drops the ranks that have finished report (a rank writes its counters last)."""
    total = 0
    for f in parts.glob("rank*/counters.json"):
        try:
            counters = gate.read_json(f, "")
        except (OSError, TextError):
            continue
        dropped = counters.get("dropped", 0) if isinstance(counters, dict) else 0
        total += dropped if isinstance(dropped, int) and not isinstance(dropped, bool) else 0
    return total
