"""What every detector (ours and the baselines) gets: one aligned trace, linked,
as columns.

Every reader (our Parquet store, Chrome JSON, torch.profiler directories)
ends here: its events become ``EventColumns``, their sync ops a ``SyncTable``,
and unless already aligned every clock is fitted to the reference rank's
(``table.fit_clocks``). MegaScan reads the columns; the per-event view
(``ScanInput.events`` / ``ScanInput.ops``), built on first use, is the one
adapter for what still reads events (the baselines, analyze, align, query).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np

from megatronapp.host.limits import Batching
from megatronapp.io.progress import Say, quiet
from megatronapp.scenario.config import Scenario
from megatronapp.trace.columns import (EventColumns, RankEventsView, TableSource, columns_from_events,
                                       empty_columns)
from megatronapp.trace.events import Event
from megatronapp.trace.metrics import distinct_ints
from megatronapp.trace.classes import Expansion
from megatronapp.trace.store import (TRACE_FILE, CutReader, Pieces, StoreError, StoreMeta, local_clock_view,
                                     read_columns, read_meta, read_pieces)

from megatronapp.scan.align.align import ClockFit
from megatronapp.scan.ingest.deps import SyncOp, reconstruct
from megatronapp.scan.ingest.load import (LoadedTrace, RankEvents, TraceError, dig, load_trace, locate_trace,
                   read_object, trace_size)
from megatronapp.scan.ingest.folders import ALL
from megatronapp.scan.ingest.sketch import DEFAULT_CAPACITY
from megatronapp.scan.align.table import COLLECTIVE_KIND, SyncTable, apply_clocks, fit_clocks, sorted_like_loader, sync_table
from megatronapp.scan.ingest.twins import Twins, twins_in
from megatronapp.scan.ingest.work import scenario_of_run

DEFAULT_GPUS_PER_NODE = 8


@dataclass(frozen=True)
class ScanInput:
    """Aligned columns (rows by rank, then start), their sync ops, and what is
    known of the run."""

    cols: EventColumns  # aligned to the reference rank's clock
    sync: SyncTable
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    clocks: dict[int, ClockFit] = field(default_factory=dict)
    scenario: Scenario | None = None  # what the run ran, when known: the work each op models
    # A symmetric run read by its present replicas (``twins``): each present
    # rank's rows stand for its twins'
    twins: Twins | None = None

    @property
    def ranks(self) -> list[int]:
        return distinct_ints(self.cols.rank)[0].astype(int).tolist()

    @property
    def job_events(self) -> int:
        """The job's events this input stands for (its rows, each present
        rank's once per twin, with the collectives across replicas)."""
        if self.twins is None:
            return len(self.cols)
        return int(self.twins.weight[self.cols.rank].sum())

    @cached_property
    def events(self) -> RankEvents:
        """The aligned events per rank (built on first use)."""
        return dict(RankEventsView(TableSource(self.cols)))

    @cached_property
    def ops(self) -> tuple[SyncOp, ...]:
        """The sync ops over ``events`` (member = (rank, index in its events))."""
        return tuple(reconstruct(self.events))


def gpus_per_node_of(run_dir: Path | None, default: int = DEFAULT_GPUS_PER_NODE) -> int:
    """The run's scenario's GPUs per node (its summary.json, validated), else ``default``."""
    summary = run_dir / "summary.json" if run_dir else None
    if summary is None or not summary.is_file():
        return default
    value = dig(read_object(summary), "scenario.cluster.gpus_per_node", summary)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceError(str(summary), "scenario.cluster.gpus_per_node must be an integer "
                         f">= 1, got {value!r:.40}")
    return value


def prepare_columns(cols: EventColumns, aligned: bool, gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
                    ref: int | None = None, say: Say = quiet) -> ScanInput:
    """Link sync ops and, unless already aligned, align every clock to ``ref``."""
    say("linking sync ops")
    cols = sorted_like_loader(cols)
    sync = sync_table(cols)
    if aligned:
        return ScanInput(cols, sync, gpus_per_node)
    say(f"aligning {len(np.unique(cols.rank))} clocks")
    fits = fit_clocks(cols, sync, ref)
    return ScanInput(apply_clocks(cols, fits), sync, gpus_per_node, fits)


def columns_of(events: Mapping[int, Sequence[Event]]) -> EventColumns:
    """``events`` as columns (the table itself when they are a view of one)."""
    if isinstance(events, RankEventsView) and isinstance(events.source, TableSource):
        return events.source.table
    return columns_from_events(events)


def prepare(events: Mapping[int, Sequence[Event]], aligned: bool, gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
            ref: int | None = None, say: Say = quiet) -> ScanInput:
    """``prepare_columns`` of per-rank events (Chrome JSON, Kineto, a run in memory)."""
    return prepare_columns(columns_of(events), aligned, gpus_per_node, ref, say)


def prepare_loaded(trace: LoadedTrace, say: Say = quiet) -> ScanInput:
    scan = prepare(trace.events, trace.aligned, gpus_per_node_of(trace.run_dir), say=say)
    return replace(scan, scenario=scenario_of_run(trace.run_dir))


def load_scan_input(target: str | Path, say: Say = quiet,
                    max_bytes: float | None = None, cycle: int | str = ALL) -> ScanInput:
    """``max_bytes``: the cap on each JSON file's text; ``cycle``: of a
    torch.profiler folder's profiling cycles, which (``load_trace``)."""
    return prepare_loaded(load_trace(target, say=say, max_bytes=max_bytes, cycle=cycle), say)


def store_of(target: str | Path) -> Path | None:
    """The ``trace.parquet`` a target names (a run directory or the file), if any."""
    path = Path(target)
    if path.is_dir() and (path / TRACE_FILE).is_file():
        return path / TRACE_FILE
    return path if path.suffix == ".parquet" and path.is_file() else None


@dataclass(frozen=True)
class StoredColumns:
    """A stored run's typed columns as read, before linking and alignment."""

    cols: EventColumns
    aligned: bool  # every clock is the reference clock already
    gpus_per_node: int
    scenario: Scenario | None

    def prepared(self, cols: EventColumns | None = None,
                 clocks: dict[int, ClockFit] | None = None) -> ScanInput:
        """These columns (or a cut of them, ``cols``) linked and aligned: by
        ``clocks`` when given (fitted on another cut), else fitted here."""
        cols = self.cols if cols is None else cols
        if self.aligned or clocks is None:
            scan = prepare_columns(cols, self.aligned, self.gpus_per_node)
        else:
            cols = sorted_like_loader(cols)
            scan = ScanInput(apply_clocks(cols, clocks), sync_table(cols), self.gpus_per_node,
                             clocks)
        return replace(scan, scenario=self.scenario)


def read_stored(store: Path, raw_clocks: bool = True,
                iterations: Sequence[int] | None = None) -> StoredColumns:
    """A stored run's typed columns (its ``iterations`` only, when given). Each
    rank is read on its own clock, unless every clock is the reference clock
    (then the local view is the aligned one already)."""
    try:
        cols, meta = read_columns(store, iterations=iterations, with_args=False)  # typed columns suffice
    except StoreError as err:
        raise _trace_error(store, err) from None
    return _as_stored(store, cols, meta, raw_clocks)


def _trace_error(store: Path, err: StoreError) -> TraceError:
    return TraceError(str(store), str(err).removeprefix(f"{store}: "))


def _as_stored(store: Path, cols: EventColumns, meta: StoreMeta, raw_clocks: bool = True
               ) -> StoredColumns:
    """Columns read from ``store`` (whose metadata is ``meta``), each rank on its
    own clock when ``raw_clocks``, with what the run directory tells of the run."""
    return _on_clocks(_run_facts(store, meta), cols, meta, raw_clocks)


def _run_facts(store: Path, meta: StoreMeta) -> StoredColumns:
    """What the run directory of ``store`` tells of the run (no columns yet)."""
    stored = int(meta.extra.get("topology", {}).get("gpus_per_node", DEFAULT_GPUS_PER_NODE))
    run_dir = store.parent if store.name == TRACE_FILE else None
    gpus = gpus_per_node_of(run_dir, stored)  # as the per-event path reads it
    return StoredColumns(empty_columns(), True, gpus, scenario_of_run(run_dir))


def _on_clocks(facts: StoredColumns, cols: EventColumns, meta: StoreMeta, raw_clocks: bool = True
               ) -> StoredColumns:
    """``cols`` with the run's ``facts``, each rank on its own clock when ``raw_clocks``."""
    skewed = bool(meta.clocks) and raw_clocks
    if skewed:
        cols = local_clock_view(cols, meta.clocks)
    return replace(facts, cols=cols, aligned=not skewed)


def load_table_scan(store: Path, raw_clocks: bool = True) -> ScanInput:
    """A stored run as the detector's input, without an object per event,
    aligned (``read_stored``, then ``prepare_columns``)."""
    return read_stored(store, raw_clocks).prepared()


def stored_batches(store: Path) -> Iterator[ScanInput]:
    """A stored run as the detector's batches: a few whole iterations at a
    time (``iteration_batches``), each linked and aligned on its own. An
    iteration of more than ``BATCH_ROWS`` events is cut by data-parallel
    replicas (``replica_cuts``): each batch holds whole iterations of whole
    pipelines, their collectives with the other replicas joined among the
    replicas present. A symmetric store is read by its present replicas (one
    of each kind) only, each standing for its twins. The file is read once,
    split by iteration and microbatch (``store.read_pieces``), each piece
    decoded for the ranks of one batch at a time. A full store read as one
    group of iterations is not split: each batch decodes only the row groups
    that hold its replicas (``store.row_groups_of``)."""
    groups = iteration_batches(store)
    try:
        meta = read_meta(store)
        if len(groups) == 1 and meta.stand_ins is None:
            yield from _cut_batches(store, meta, groups[0])
            return
        pieces = read_pieces(store)
    except StoreError as err:
        raise _trace_error(store, err) from None
    facts = _run_facts(store, pieces.meta)  # read once, not per batch
    twins = twins_of(pieces.meta, facts.scenario)
    for iterations in groups:
        keys = [k for k in sorted(pieces.streams) if iterations is None or k[0] in iterations]
        if twins is not None:
            yield twin_batch(pieces, keys, facts, twins)
            continue
        rows = sum(pieces.events[k] for k in keys)
        for ranks in replica_cuts(rows, facts.scenario, pieces.meta.world_size):
            yield _on_clocks(facts, pieces.columns(keys, ranks), pieces.meta).prepared()


def _cut_batches(store: Path, meta: StoreMeta, iterations: list[int] | None
                 ) -> Iterator[ScanInput]:
    """A full store's ``iterations`` as batches of whole replicas
    (``replica_cuts``), each read from the row groups that hold its ranks."""
    facts = _run_facts(store, meta)
    reader = CutReader(store)
    for ranks in replica_cuts(stored_events(store), facts.scenario, meta.world_size):
        cols = reader.columns(None if ranks is None else ranks.tolist(), iterations)
        yield _on_clocks(facts, cols, meta).prepared()


def replica_cuts(rows: int, scenario: Scenario | None, world: int) -> list[np.ndarray | None]:
    """The ranks of each batch an iteration of ``rows`` events is read in:
    all at once (None) if it fits ``BATCH_ROWS``, else groups of whole
    data-parallel replicas (two at least, so that each stage has a peer)."""
    if rows <= BATCH_ROWS or scenario is None or scenario.parallel.dp < 2:
        return [None]
    tp, dp = scenario.parallel.tp, scenario.parallel.dp
    per_cut = max(2, -(-dp * BATCH_ROWS // rows))
    replica = (np.arange(world) // tp) % dp
    return [np.flatnonzero((replica >= lo) & (replica < lo + per_cut))
            for lo in range(0, dp, per_cut)]


def twins_of(meta: StoreMeta, scenario: Scenario | None) -> Twins | None:
    """The twin replicas of a symmetric store whose clocks are all the
    reference clock (a skewed rank is not its twin's copy), else None."""
    stand_ins = meta.stand_ins
    if stand_ins is None or meta.clocks or scenario is None:
        return None
    p = scenario.parallel
    return twins_in(stand_ins, p.tp, p.dp, p.pp, meta.groups)


def twin_batch(pieces: Pieces, keys: Sequence[tuple[int, int]], facts: StoredColumns,
               twins: Twins) -> ScanInput:
    """The pieces ``keys`` of a symmetric store as one batch read by its
    present replicas (``ScanInput.twins``): their rows, their collectives with
    the other replicas joined among themselves (a twin arrives when its
    present replica does)."""
    own = Expansion(pieces.stored(keys), twins.stand_ins, twins.group_table).rows(twins.present)
    return replace(prepare_columns(own, True, facts.gpus_per_node), scenario=facts.scenario,
                   twins=twins)


BATCH_ROWS = 1 << 20  # events a stored run's batch holds at most (unless one iteration has more)


def iteration_batches(store: Path, max_rows: int | None = None) -> list[list[int] | None]:
    """The iterations of a stored run to read together, in order: as many
    whole iterations as ``max_rows`` events (``BATCH_ROWS``) hold (at least one); ``[None]``
    (all at once) when its scenario, hence its iteration count, is unknown."""
    run_dir = store.parent if store.name == TRACE_FILE else None
    scenario = scenario_of_run(run_dir)
    if scenario is None or scenario.iterations < 2:
        return [None]
    step = max(1, int((max_rows or BATCH_ROWS) * scenario.iterations // max(stored_events(store), 1)))
    return [list(range(i, min(i + step, scenario.iterations)))
            for i in range(0, scenario.iterations, step)]


STATE_KEYS_PER_RANK = 8  # samples the detector keeps per rank: its ratios, op names, channels


def batching(store: Path) -> Batching:
    """What ``stored_batches`` will hold at most, from the footer's row count,
    the classes and the run's scenario (no row is read): its largest batch (a
    long iteration's first microbatch with the events of none: twice a
    microbatch's share, a safe side) and the detector's bounded state; a
    store read by twin replicas: their share of both, and every rank's
    share of the state at the verdict."""
    events = stored_events(store)
    groups = iteration_batches(store)
    scenario = scenario_of_run(store.parent if store.name == TRACE_FILE else None)
    iterations = scenario.iterations if scenario is not None and groups != [None] else 1
    largest = events * max(len(g) if g is not None else iterations for g in groups) // iterations
    cuts = replica_cuts(largest, scenario, scenario.world_size if scenario else 1)
    if cuts != [None] and scenario is not None:
        largest = largest * max(len(c) for c in cuts if c is not None) // scenario.world_size
    try:
        meta = read_meta(store)
    except StoreError as err:
        raise _trace_error(store, err) from None
    twins = twins_of(meta, scenario)
    # a key keeps a value per iteration, up to its capacity
    kept = min(DEFAULT_CAPACITY, iterations) if scenario is not None else DEFAULT_CAPACITY
    if twins is None:
        return Batching(largest, min(events, meta.world_size * STATE_KEYS_PER_RANK * kept))
    present = len(twins.present)  # read by replicas: their share of every batch and the state
    return Batching(largest * present // twins.world,
                    min(events, present * STATE_KEYS_PER_RANK * kept),
                    events * present // twins.world, twins.world)


def stored_events(store: Path) -> int:
    """The events a stored run holds (its Parquet footer's row count)."""
    return trace_size(locate_trace(store)).stored_events
