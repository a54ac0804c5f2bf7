"""What every detector (ours and the baselines) gets: one aligned trace, linked."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from megatronapp.scenario.config import Scenario
from megatronapp.io.progress import Say, quiet

from .align import ClockFit, apply_clocks, fit_clocks
from .deps import SyncOp, reconstruct
from .load import LoadedTrace, RankEvents, TraceError, dig, load_trace, read_object
from .work import scenario_of_run

DEFAULT_GPUS_PER_NODE = 8
STAGE_PEER_WORDS = ("tp", "dp", "tensor", "data")  # collectives among ranks doing identical work


@dataclass(frozen=True)
class ScanInput:
    events: RankEvents  # aligned to the reference rank's clock
    ops: tuple[SyncOp, ...]
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    clocks: dict[int, ClockFit] = field(default_factory=dict)
    scenario: Scenario | None = None  # what the run ran, when known: the work each op models

    @property
    def ranks(self) -> list[int]:
        return sorted(self.events)


def stage_peers(scan: ScanInput) -> dict[int, tuple[int, ...]]:
    """rank -> ranks that run the same compute (its TP and DP collective groups)."""
    parent = {r: r for r in scan.events}

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for op in scan.ops:
        lowered = op.name.lower()
        if op.kind != "collective" or lowered.split("_")[0] not in STAGE_PEER_WORDS:
            continue
        first = find(op.ranks[0])
        for r in op.ranks[1:]:
            parent[find(r)] = first
    classes: dict[int, list[int]] = {}
    for r in sorted(scan.events):
        classes.setdefault(find(r), []).append(r)
    return {r: tuple(classes[find(r)]) for r in scan.events}


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


def prepare(events: RankEvents, aligned: bool, gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
            ref: int | None = None, say: Say = quiet) -> ScanInput:
    """Link sync ops and, unless already aligned, align every clock to ``ref``."""
    say("linking sync ops")
    ops = reconstruct(events)
    if aligned:
        return ScanInput(events, tuple(ops), gpus_per_node)
    say(f"aligning {len(events)} clocks")
    fits = fit_clocks(events, ops, ref)
    return ScanInput(apply_clocks(events, fits), tuple(ops), gpus_per_node, fits)


def prepare_loaded(trace: LoadedTrace, say: Say = quiet) -> ScanInput:
    scan = prepare(dict(trace.events), trace.aligned, gpus_per_node_of(trace.run_dir), say=say)
    return replace(scan, scenario=scenario_of_run(trace.run_dir))


def load_scan_input(target: str | Path, say: Say = quiet,
                    max_bytes: float | None = None) -> ScanInput:
    """``max_bytes``: the cap on each JSON file's text (``load_trace``)."""
    return prepare_loaded(load_trace(target, say=say, max_bytes=max_bytes), say)
