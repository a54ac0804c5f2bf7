"""Per-rank timeline plot (forward / backward / communication coloured), and
what every figure of the project shares: colours, saving, tick thinning and
the mark on a root cause's row.

Figures are built as ``matplotlib.figure.Figure`` objects (no pyplot state),
so tests inspect what was drawn and the command saves them."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .kinds import event_kind
from .events import Event

COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "optimizer": "#55A868",
           "compute": "#64B5CD", "p2p": "#8C8C8C", "collective": "#C44E52", "other": "#937860"}
LEGEND = {"compute": "other compute (GPU kernels, ops)", "other": "steps, memory copies"}
ALWAYS_IN_LEGEND = ("forward", "backward", "optimizer", "p2p", "collective")
ROOT_COLOUR = "#D62728"
MAX_TICK_LABELS = 40  # more labels than this overlap on a figure of any height
DPI = 110


def colour_of(e: Event) -> str:
    return COLOURS[colour_key(e)]


def colour_key(e: Event) -> str:
    if e.name in COLOURS:
        return e.name
    cat = event_kind(e.name, e.args)
    return cat if cat in COLOURS else "other"


def save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    return path


def tick_step(count: int, most: int = MAX_TICK_LABELS) -> int:
    """Label every n-th of ``count`` rows so that at most ``most`` labels show."""
    return max(1, -(-count // most))


def rank_ticks(ax: Axes, ranks: Sequence[int], offset: float = 0.0,
               label: str = "rank {}") -> None:
    """Rank labels, thinned to at most MAX_TICK_LABELS."""
    step = tick_step(len(ranks))
    rows = list(range(0, len(ranks), step))
    ax.set_yticks([r + offset for r in rows], [label.format(ranks[r]) for r in rows])


def mark_row(ax: Axes, row: int, label: str, height: float = 1.0, offset: float = 0.0) -> None:
    """Outline one row across the whole plot and name it (the root cause)."""
    left, right = ax.get_xlim()
    ax.add_patch(Rectangle((left, row + offset), right - left, height, fill=False,
                           edgecolor=ROOT_COLOUR, linewidth=2, zorder=5))
    ax.annotate(label, xy=(right, row + offset + height / 2), xytext=(-4, 0),
                textcoords="offset points", ha="right", va="center", fontsize=9,
                color=ROOT_COLOUR, fontweight="bold", zorder=6,
                bbox={"boxstyle": "round", "fc": "white", "ec": ROOT_COLOUR, "alpha": 0.9})


def note(fig: Figure, text: str) -> None:
    """A line under the figure saying what it leaves out (e.g. the ranks not drawn)."""
    if text:
        fig.text(0.01, 0.005, text, fontsize=8, ha="left", va="bottom", style="italic")


def _lanes(events: Mapping[int, Sequence[Event]], ranks: Sequence[int], t0: float
           ) -> dict[str, np.ndarray]:
    """colour key -> rows of (x, width, y) rectangles: compute in a row's upper
    half, communication in its lower half (the y axis runs down)."""
    rects: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for row, rank in enumerate(ranks):
        for e in events[rank]:
            comm = event_kind(e.name, e.args) != "compute"
            rects[colour_key(e)].append((e.start_s - t0, max(e.dur_s, 1e-9),
                                         row + (0.5 if comm else 0.05)))
    return {key: np.asarray(r, float) for key, r in rects.items()}


def _boxes(xywh: np.ndarray, height: float) -> np.ndarray:
    """(n, 4, 2) corners of n rectangles of one height."""
    x, w, y = xywh[:, 0], xywh[:, 1], xywh[:, 2]
    corners = [(x, y), (x + w, y), (x + w, y + height), (x, y + height)]
    return np.stack([np.stack(c, axis=-1) for c in corners], axis=1)


def timeline_figure(events: Mapping[int, Sequence[Event]], title: str = "",
                    root: int | None = None, root_label: str = "",
                    selection: str = "") -> Figure:
    """One row per rank, top to bottom: compute (forward, backward, optimizer)
    in the upper half of each row, communication (p2p, collectives) in the
    lower half; one collection per colour, whatever the number of events.
    ``root`` (a drawn rank) is outlined and labelled ``root_label``;
    ``selection`` says which ranks are drawn when not all of them are."""
    ranks = sorted(events)
    t0 = min((e.start_s for r in ranks for e in events[r]), default=0.0)
    fig = Figure(figsize=(14, max(0.4 * len(ranks), 2.5) + 1.8), layout="constrained")
    ax = fig.add_subplot()
    lanes = _lanes(events, ranks, t0)
    for key, xywh in lanes.items():
        ax.add_collection(PolyCollection(list(_boxes(xywh, 0.4)), facecolors=COLOURS[key],
                                         linewidths=0, label=key))
    ax.autoscale_view()
    ax.set_ylim(len(ranks), 0)
    rank_ticks(ax, ranks, 0.5)
    ax.set_ylabel("rank (upper half: compute, lower half: communication)")
    ax.set_xlabel("time since the first event (s)")
    ax.set_title(title or "timeline")
    if root in ranks:
        mark_row(ax, ranks.index(root), root_label or f"root cause: rank {root}")
    ax.legend(handles=[Patch(color=c, label=LEGEND.get(k, k)) for k, c in COLOURS.items()
                       if k in lanes or k in ALWAYS_IN_LEGEND],
              title="event", loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    note(fig, selection)
    return fig


def plot_timeline(events: Mapping[int, Sequence[Event]], path: Path, title: str = "",
                  root: int | None = None, root_label: str = "", selection: str = "") -> Path:
    """``timeline_figure`` saved as a PNG at ``path``."""
    return save(timeline_figure(events, title, root, root_label, selection), path)
