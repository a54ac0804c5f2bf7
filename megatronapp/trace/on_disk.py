"""A run's trace on disk: ``trace.parquet`` (every event in true time, each
rank's clock in its metadata) and, for jobs a browser can open, ``trace.json``.
Apart from ``run.write`` so that harnesses (detector validation) write trials the
way runs are written without importing what reads them back."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from .classes import StandIns
from .columns import EventSource, TableSource, source_of
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
                     {"topology": {"tp": p.tp, "pp": p.pp, "dp": p.dp_cp,  # cp folds into dp
                                   "gpus_per_node": s.cluster.gpus_per_node},
                      "labels": labels})


Phase = Callable[[str, int, str], Callable[[int], None]]  # (what, total, unit) -> advance


def write_traces(s: Scenario, result: RunResult, out_dir: Path,
                 phase: Phase | None = None) -> dict[str, Any]:
    """trace.parquet (every event, true time, clocks in its metadata; a job
    with classes of identical ranks: the representatives' events and the
    classes, ``trace.classes``) and, for jobs a browser can open, trace.json
    (aligned clock)."""
    source = source_of(result)
    meta = store_meta(s, result, source)
    stand_ins = StandIns.of(source.stand_ins(), meta.world_size)
    stored: EventSource = TableSource(source.compact()[0]) if stand_ins.reduced else source
    if stand_ins.reduced:
        meta = replace(meta, extra={**meta.extra, "events": source.events,
                                    "classes": stand_ins.to_json()})
    advance = phase("writing trace.parquet", stored.events, "events") if phase else None
    rows = write_events(out_dir / TRACE_FILE, stored, meta, advance or (lambda _n: None))
    browser = source.events <= BROWSER_EVENTS
    if browser:
        write_chrome(out_dir / "trace.json", source.batches(), result.label, {"clock": "aligned"})
    written = {"stored_events": rows} if stand_ins.reduced else {}
    return {"events": source.events, **written, "trace_json": browser}
