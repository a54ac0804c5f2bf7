"""MegaScan's plots: a rank x op heat map of mean durations (MegaScale Fig. 7
style) and an enhanced Marey graph of one iteration of one pipeline."""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.colors import LinearSegmentedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from megatronapp.trace.timeline import COLOURS, mark_row, note, rank_ticks, save, tick_step

from megatronapp.trace.events import Event
from megatronapp.trace.kinds import event_kind

from megatronapp.scan.evidence.focus import PlotFocus

Events = Mapping[int, Sequence[Event]]  # rank -> its events (a dict, or a view of columns)


# A profiler's names carry what differs per call after '#' (ProfilerStep#7,
# Optimizer.step#SGD.step) and autograd's wrapper before the op: one column
# per class of op, not one per iteration.
_CALL_SUFFIX = re.compile(r"#.*$")
AUTOGRAD_WRAPPER = "autograd::engine::evaluate_function: "
MAX_COLUMNS = 24  # beyond this, the ops with the least time are pooled into one column
MAX_LABEL = 32  # characters of a column's label (GPU kernels' names run to hundreds)
OTHER_OPS = "other ops"


def op_class(name: str) -> str:
    """``ProfilerStep#7`` -> ``ProfilerStep``; ``autograd::engine::evaluate_function:
    ReluBackward0`` -> ``ReluBackward0``; our own op names are unchanged."""
    return _CALL_SUFFIX.sub("", name.removeprefix(AUTOGRAD_WRAPPER)) or name


def short_label(name: str, most: int = MAX_LABEL) -> str:
    return name if len(name) <= most else name[:most - 1] + "\u2026"


def _pooled(sums: dict[tuple[int, str], list[float]]) -> dict[tuple[int, str], list[float]]:
    """At most ``MAX_COLUMNS`` classes: the rest, by total time, in ``OTHER_OPS``."""
    total: dict[str, float] = defaultdict(float)
    for (_, name), durations in sums.items():
        total[name] += sum(durations)
    if len(total) <= MAX_COLUMNS:
        return sums
    kept = set(sorted(total, key=lambda n: -total[n])[:MAX_COLUMNS - 1])
    pooled: dict[tuple[int, str], list[float]] = defaultdict(list)
    for (rank, name), durations in sums.items():
        pooled[(rank, name if name in kept else OTHER_OPS)].extend(durations)
    return pooled


def mean_durations(events: Events) -> tuple[list[int], list[str], np.ndarray]:
    """ranks, op classes (``op_class``; at most ``MAX_COLUMNS``), matrix of mean
    duration in ms (NaN where a rank lacks the op)."""
    sums: dict[tuple[int, str], list[float]] = defaultdict(list)
    for rank, evs in events.items():
        for e in evs:
            sums[(rank, op_class(e.name))].append(e.dur_s)
    sums = _pooled(sums)
    ranks = sorted(events)
    names = sorted({name for _, name in sums})
    grid = np.full((len(ranks), len(names)), np.nan)
    for i, r in enumerate(ranks):
        for j, n in enumerate(names):
            if (r, n) in sums:
                grid[i, j] = 1e3 * float(np.mean(sums[(r, n)]))
    return ranks, names, grid


def compute_columns(events: Events, names: Sequence[str]) -> np.ndarray:
    """Per column, whether its ops are mostly compute (the rest: communication,
    which holds the time a rank waits for its peers, and annotations)."""
    votes: dict[str, int] = defaultdict(int)
    for evs in events.values():
        for e in evs:
            votes[op_class(e.name)] += 1 if event_kind(e.name, e.args) == "compute" else -1
    return np.array([votes.get(n, 0) > 0 for n in names])


COMPUTE_MAP = "Reds"
# waits in their own, paler colour: a victim's long wait never outshines a slow compute
WAIT_MAP = LinearSegmentedColormap.from_list("waits", ["#ffffff", "#6f9fcf"])
WAIT_CAP = 4.0  # a wait 4x its median is as dark as a wait gets
MIN_COMPUTE_TOP = 1.25  # noise alone (a few % apart) stays pale


def _ratio_layers(grid: np.ndarray, compute: np.ndarray
                  ) -> tuple[np.ma.MaskedArray, np.ma.MaskedArray, float]:
    """Each cell's mean over its column's median (only slower than the median
    is coloured), split into compute and wait layers, and the compute scale's top."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.maximum(grid / np.nanmedian(grid, axis=0, keepdims=True), 1.0)
    missing = ~np.isfinite(ratio)
    as_compute = np.ma.masked_array(ratio, missing | ~compute[None, :])
    as_wait = np.ma.masked_array(ratio, missing | compute[None, :])
    top = max(MIN_COMPUTE_TOP, float(as_compute.max()) if as_compute.count() else 0.0)
    return as_compute, as_wait, top


def heatmap_figure(events: Events, title: str = "", focus: PlotFocus = PlotFocus()
                   ) -> Figure:
    """Colour = mean duration over that op's median over ranks, so a slow rank
    shows up whatever the op's absolute length. Compute is red, scaled to the
    slowest compute cell, so a root cause's excess compute is the darkest cell;
    communication (a victim's waits) is a paler blue, capped, so waiting never
    outshines it. The root cause's row is outlined and named."""
    ranks, names, grid = mean_durations(events)
    compute = compute_columns(events, names)
    order = np.argsort(~compute, kind="stable")  # compute columns first, then the waits
    names, grid, compute = [names[j] for j in order], grid[:, order], compute[order]
    as_compute, as_wait, top = _ratio_layers(grid, compute)
    # wide enough for each column's label, never wider than a page; tall enough
    # for the rotated labels under a few ranks
    fig = Figure(figsize=(min(0.55 * len(names) + 6, 19), min(0.22 * len(ranks) + 4, 14)),
                 layout="constrained")
    ax = fig.add_subplot()
    ax.set_facecolor("#e8e8e8")  # a rank without the op
    hot = ax.imshow(as_compute, aspect="auto", cmap=COMPUTE_MAP, interpolation="nearest",
                    vmin=1.0, vmax=top)
    waits = ax.imshow(as_wait, aspect="auto", cmap=WAIT_MAP, interpolation="nearest",
                      vmin=1.0, vmax=WAIT_CAP)
    ax.set_xticks(range(len(names)), [short_label(n) for n in names], rotation=40, ha="right")
    rank_ticks(ax, ranks, label="{}")
    ax.set_xlabel("operation (class)")
    ax.set_ylabel("rank")
    fig.colorbar(hot, ax=ax, label="compute: mean / median over ranks (x)")
    fig.colorbar(waits, ax=ax, label=f"communication and waits:\nmean / median (x, "
                                     f"capped at {WAIT_CAP:g}x)")
    if focus.root in ranks:
        mark_row(ax, ranks.index(focus.root), focus.root_label, offset=-0.5)
    ax.set_title(title or "mean op duration per rank")
    note(fig, focus.selection)
    return fig


def plot_heatmap(events: Events, path: Path, title: str = "",
                 focus: PlotFocus = PlotFocus()) -> Path:
    return save(heatmap_figure(events, title, focus), path)


def _successors(events: Events) -> dict[int, int]:
    """Each rank's next pipeline stage, from its send_forward peers."""
    nxt: dict[int, int] = {}
    for rank, evs in events.items():
        for e in evs:
            if e.name == "send_forward" and e.args.get("peer") in events:  # a rank we have
                nxt.setdefault(rank, int(e.args["peer"]))
    return nxt


def _chain(nxt: dict[int, int], first: int) -> list[int]:
    order = [first]
    while nxt.get(order[-1]) is not None and nxt[order[-1]] not in order:
        order.append(nxt[order[-1]])
    return order


def pipelines(events: Events) -> list[list[int]]:
    """Every pipeline drawn from ``events``, each in stage order."""
    nxt = _successors(events)
    heads = sorted(r for r in events if r not in set(nxt.values()))
    return [_chain(nxt, h) for h in heads] or [_chain(nxt, min(events))]


def pipeline_of(events: Events, holding: int | None = None) -> list[int]:
    """The pipeline that holds rank ``holding``, else the slowest one (most
    compute time in total), in stage order."""
    chains = pipelines(events)
    for chain in chains:
        if holding in chain:
            return chain
    return max(chains, key=lambda chain: _compute_time(events, chain))


def _compute_time(events: Events, ranks: Iterable[int]) -> float:
    return sum(e.dur_s for r in ranks for e in events[r] if e.name in ("forward", "backward"))


def _marey_paths(events: Events, stages: list[int], iteration: int
                 ) -> dict[tuple[str, int, int], list[tuple[float, float, int]]]:
    """(forward|backward, microbatch, chunk) -> its (start ms, end ms, stage row)."""
    t0 = min((e.start_s for r in stages for e in events[r] if e.args.get("iteration") == iteration),
             default=0.0)
    paths: dict[tuple[str, int, int], list[tuple[float, float, int]]] = defaultdict(list)
    for row, rank in enumerate(stages):
        for e in events[rank]:
            if e.args.get("iteration") != iteration or e.name not in ("forward", "backward"):
                continue
            key = (e.name, int(e.args.get("microbatch", 0)), int(e.args.get("chunk", 0)))
            paths[key].append(((e.start_s - t0) * 1e3, (e.end_s - t0) * 1e3, row))
    return paths


def marey_figure(events: Events, iteration: int = 0, title: str = "",
                 focus: PlotFocus = PlotFocus()) -> Figure:
    """Time runs right, pipeline stages run down, for the pipeline that holds
    the root cause (else the slowest one). Each microbatch's forward (and
    backward) is a line through the stages; compute is a thick segment at its
    stage, the slanted parts between stages are the transfers and waits, so a
    slow stage shows as steep, long segments on one row."""
    stages = pipeline_of(events, focus.root)
    fig = Figure(figsize=(14, 0.6 * len(stages) + 2.5), layout="constrained")
    ax = fig.add_subplot()
    bars: dict[str, list[list[tuple[float, float]]]] = defaultdict(list)
    for (name, _, _), pts in _marey_paths(events, stages, iteration).items():
        pts.sort(key=lambda p: p[0])
        bars[name] += [[(s, row), (e, row)] for s, e, row in pts]
        ax.plot([x for s, e, _ in pts for x in (s, e)], [r for _, _, r in pts for _ in (0, 1)],
                lw=0.8, color=COLOURS[name], alpha=0.7)
    for name, segments in bars.items():  # one collection per kind: fast at any size
        ax.add_collection(LineCollection(segments, linewidths=6, colors=COLOURS[name],
                                         capstyle="butt"))
    rows = range(0, len(stages), tick_step(len(stages)))
    ax.set_yticks(list(rows), [f"stage {i} (rank {stages[i]})" for i in rows])
    ax.set_ylim(len(stages) - 0.5, -0.5)
    ax.set_ylabel("pipeline stage")
    ax.set_xlabel("time in iteration (ms)")
    if focus.root in stages:
        mark_row(ax, stages.index(focus.root), focus.root_label, offset=-0.5)
    ax.legend(handles=[Line2D([], [], color=COLOURS[k], lw=6, label=f"{k} (compute at a stage)")
                       for k in ("forward", "backward")] +
              [Line2D([], [], color="#555", lw=0.8, label="microbatch path (slant: transfer, wait)")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(title or f"Marey graph, iteration {iteration}")
    return fig


def plot_marey(events: Events, path: Path, iteration: int = 0, title: str = "",
               focus: PlotFocus = PlotFocus()) -> Path:
    return save(marey_figure(events, iteration, title, focus), path)


def plot_hook(run_dir: Path, events: Events, focus: PlotFocus = PlotFocus()) -> list[Path]:
    """Extra plots for ``megatronapp plot``."""
    out = [plot_heatmap(events, run_dir / "scan_heatmap.png",
                        title=f"{run_dir.name}: mean op time", focus=focus)]
    if any(e.name == "send_forward" for evs in events.values() for e in evs):
        out.append(plot_marey(events, run_dir / "scan_marey.png",
                              title=f"{run_dir.name}: Marey graph", focus=focus))
    return out
