"""A run's trace on disk: ``trace.parquet`` (every event in true time, each
rank's clock in its metadata) and, for jobs a browser can open, ``trace.json``.
Apart from ``run.write`` so that harnesses (detector validation) write trials the
way runs are written without importing what reads them back."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from .columns import EventSource, source_of
from ..scenario.config import Scenario
from .store import TRACE_FILE, StoreMeta, write_events
from .chrome import BROWSER_EVENTS, write_chrome
from .events import RunResult


def store_meta(s: Scenario, result: RunResult, source: EventSource) -> StoreMeta:
    """What trace.parquet records beside its rows: groups, clocks, topology and
    the labels that differ from the topology's (MegaFBD's worker threads)."""
    labels = {str(r): result.label(r) for r in source.ranks()
              if r >= result.topo.world_size or result.label(r) != result.topo.label(r)}
    p = s.parallel
    return StoreMeta(len(source.ranks()), tuple(source.groups), dict(result.clocks),
                     {"topology": {"tp": p.tp, "pp": p.pp, "dp": p.dp,
                                   "gpus_per_node": s.cluster.gpus_per_node},
                      "labels": labels})


Phase = Callable[[str, int, str], Callable[[int], None]]  # (what, total, unit) -> advance


def write_traces(s: Scenario, result: RunResult, out_dir: Path,
                 phase: Phase | None = None) -> dict[str, Any]:
    """trace.parquet (every event, true time, clocks in its metadata) and, for
    jobs a browser can open, trace.json (aligned clock)."""
    source = source_of(result)
    advance = phase("writing trace.parquet", source.events, "events") if phase else None
    rows = write_events(out_dir / TRACE_FILE, source, store_meta(s, result, source),
                        advance or (lambda _n: None))
    browser = rows <= BROWSER_EVENTS
    if browser:
        write_chrome(out_dir / "trace.json", source.batches(), result.label, {"clock": "aligned"})
    return {"events": rows, "trace_json": browser}
