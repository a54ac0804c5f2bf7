"""What the plots of a run draw: its events (on a large run only the ranks that
matter, read from ``trace.parquet``) and MegaScan's diagnosis of the same run,
so that every figure can point at the root cause."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from megatronapp.trace.columns import EventColumns
from megatronapp.host.limits import COSTS, TraceCost
from megatronapp.io.progress import Say, quiet
from megatronapp.trace.events import Event

from megatronapp.scan.diagnosis import Diagnosis

if TYPE_CHECKING:
    from megatronapp.scan.align.inputs import ScanInput

MAX_RANKS = 64  # more rows than this are unreadable on one figure


@dataclass(frozen=True)
class PlotFocus:
    """The root cause to mark (None on a healthy run), its victims, and a note
    saying which ranks the figures draw when not all of them."""

    root: int | None = None
    root_label: str = ""
    victims: tuple[int, ...] = ()
    selection: str = ""


@dataclass(frozen=True)
class PlotInput:
    events: Mapping[int, Sequence[Event]]
    diagnosis: Diagnosis
    focus: PlotFocus


def focus_of(diagnosis: Diagnosis, selection: str = "") -> PlotFocus:
    if diagnosis.healthy:
        return PlotFocus(victims=diagnosis.victims, selection=selection)
    cause = diagnosis.root_causes[0]
    what = f"link {cause.rank}->{cause.peer}" if cause.kind == "link" else f"rank {cause.rank}"
    label = f"root cause: {what} ({cause.kind}, confidence {cause.confidence:.2f})"
    return PlotFocus(cause.rank, label, diagnosis.victims, selection)


def plot_cost(target: Path) -> TraceCost:
    """A stored run is diagnosed from its columns and at most MAX_RANKS ranks
    are drawn, so it costs what detect costs; JSON input is all objects."""
    from megatronapp.scan.align.inputs import store_of

    return COSTS.detect_columns if store_of(target) else COSTS.plot


def load_plot_input(target: Path, max_bytes: float | None = None, say: Say = quiet,
                    max_ranks: int = MAX_RANKS, cycle: int | str = "all") -> PlotInput:
    """A stored run is diagnosed from its columns, then only the ranks drawn
    are read as events; other inputs (trace.json, torch.profiler files: their
    profiling ``cycle``, or all) are read once and diagnosed as they are."""
    from megatronapp.scan.align.inputs import store_of

    store = store_of(target)
    if store is not None:
        return _stored_input(store, say, max_ranks)
    from megatronapp.scan.align.inputs import load_scan_input

    scan = load_scan_input(target, say, max_bytes, cycle)
    say("detecting the root cause")
    return plot_input_of(scan)


def plot_input_of(scan: "ScanInput") -> PlotInput:
    """A read trace's events and MegaScan's diagnosis of them."""
    from megatronapp.scan.evidence.detect import megascan

    diagnosis = megascan(scan)
    return PlotInput(scan.events, diagnosis, focus_of(diagnosis))


def _stored_input(store: Path, say: Say, max_ranks: int) -> PlotInput:
    from megatronapp.trace.columns import RankEventsView, TableSource
    from megatronapp.trace.store import read_meta

    from megatronapp.scan.evidence.detect import megascan_stored

    say(f"detecting the root cause in {store}")
    diagnosis = megascan_stored(store)
    meta = read_meta(store)
    ranks = select_ranks(meta.world_size, meta.extra.get("topology"), diagnosis, max_ranks)
    selection = "" if len(ranks) == meta.world_size else \
        f"{len(ranks)} of {meta.world_size} ranks shown" + (
            f": rank {diagnosis.root_causes[0].rank}'s pipeline and groups first"
            if not diagnosis.healthy else "")
    say(f"reading the events of {len(ranks)} ranks")
    cols = _read_ranks(store, ranks)
    return PlotInput(RankEventsView(TableSource(cols)), diagnosis, focus_of(diagnosis, selection))


def _read_ranks(store: Path, ranks: Sequence[int]) -> EventColumns:
    from megatronapp.trace.store import read_columns

    cols, _meta = read_columns(store, ranks=ranks)
    return cols.sorted_by_rank_and_start()


def select_ranks(world: int, topology: Mapping[str, int] | None, diagnosis: Diagnosis,
                 max_ranks: int = MAX_RANKS) -> list[int]:
    """Every rank of a small run; of a large one the root cause, its pipeline,
    its tensor- and data-parallel groups, its victims, then the lowest ranks."""
    if world <= max_ranks:
        return list(range(world))
    first: list[int] = []
    if not diagnosis.healthy:
        root = diagnosis.root_causes[0].rank
        first = [root, *_peers(root, world, topology), *diagnosis.victims]
    chosen = list(dict.fromkeys(r for r in first if 0 <= r < world))[:max_ranks]
    taken = set(chosen)
    rest = (r for r in range(world) if r not in taken)
    chosen += [r for _, r in zip(range(max_ranks - len(chosen)), rest)]
    return sorted(chosen)


def _peers(rank: int, world: int, topology: Mapping[str, int] | None) -> list[int]:
    from megatronapp.parallel.topology import Topology

    if not topology or rank >= world:
        return []
    topo = Topology(tp=int(topology["tp"]), pp=int(topology["pp"]), dp=int(topology["dp"]))
    if topo.world_size != world:
        return []
    return [*topo.pp_group(rank), *topo.tp_group(rank), *topo.dp_group(rank)]
