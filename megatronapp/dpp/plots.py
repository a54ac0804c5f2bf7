"""MegaDPP figures: window metrics of a run, and the task-matrix traversal (Fig. 3)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from statistics import fmean
from typing import Mapping, Sequence

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..trace.events import Event
from .memory import trace_live_slots
from .windows import allreduce_windows, send_windows


@dataclass(frozen=True)
class WindowValues:
    """Per rank (in ``ranks`` order): mean P2P send window and mean all-reduce
    window in ms, and the most activations it held at once."""
    ranks: list[int]
    p2p_ms: list[float]
    allreduce_ms: list[float]
    peak_activations: list[int]

    def empty(self) -> bool:
        """Nothing to draw: no pipeline sends, all-reduces or stored activations
        (e.g. a profiler trace of a job without a pipeline)."""
        return not any(self.p2p_ms) and not any(self.allreduce_ms) \
            and not any(self.peak_activations)


def window_values(events: Mapping[int, Sequence[Event]]) -> WindowValues:
    ranks = sorted(events)
    by_src: dict[int, list[float]] = defaultdict(list)
    for w in send_windows(events):
        by_src[w.src].append(w.window_s)
    p2p = [fmean(by_src[r]) * 1e3 if by_src[r] else 0.0 for r in ranks]
    ar = [fmean(ws) * 1e3 if (ws := allreduce_windows(events[r])) else 0.0 for r in ranks]
    peak = [max((n for _, n in trace_live_slots(events[r])), default=0) for r in ranks]
    return WindowValues(ranks, p2p, ar, peak)


def windows_figure(events: Mapping[int, Sequence[Event]] | WindowValues,
                   title: str = "") -> Figure:
    """Per rank: mean P2P send window, mean all-reduce window, and the most
    activations it held at once (one bar per rank: readable at any size)."""
    v = events if isinstance(events, WindowValues) else window_values(events)
    ranks, p2p, ar, peak = v.ranks, v.p2p_ms, v.allreduce_ms, v.peak_activations
    fig = Figure(figsize=(15, 4.5), layout="constrained")
    axes = fig.subplots(1, 3)
    panels = ((p2p, "#8C8C8C", "sending rank", "window (ms)", "mean P2P send window"),
              (ar, "#C44E52", "rank", "window (ms)", "mean all-reduce window"),
              (peak, "#4C72B0", "rank", "stored activations (microbatch x chunk)",
               "peak live activations"))
    for ax, (values, colour, xlabel, ylabel, name) in zip(axes, panels):
        ax.bar(ranks, values, color=colour, label=name)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=name)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(len(ranks), 16)))
    axes[2].yaxis.set_major_locator(MaxNLocator(integer=True))  # whole activations
    fig.suptitle(title or "MegaDPP windows")
    return fig


def draw_traversal(ax: Axes, order: Sequence[tuple[int, int]], microbatches: int,
                   chunks: int, title: str) -> None:
    """Task matrix (rows: microbatch, columns: chunk) with visit numbers and the path."""
    step = {cell: i for i, cell in enumerate(order)}
    ax.imshow([[step[(mb, c)] for c in range(chunks)] for mb in range(microbatches)],
              cmap="Blues", alpha=0.6)
    for (mb, c), i in step.items():
        ax.text(c, mb - 0.15, f"{mb}-{c}", ha="center", va="center", fontsize=7)
        ax.text(c, mb + 0.22, f"#{i + 1}", ha="center", va="center", fontsize=6, color="#333")
    ax.plot([c for _mb, c in order], [mb for mb, _c in order], color="#C44E52", linewidth=0.8)
    ax.set_xticks(range(chunks))
    ax.set_yticks(range(microbatches))
    ax.set(xlabel="model chunk", ylabel="microbatch", title=title)
