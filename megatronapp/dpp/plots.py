"""MegaDPP figures: window metrics of a run, and the task-matrix traversal (Fig. 3)."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import fmean
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..trace.events import Event  # noqa: E402
from .memory import trace_live_slots  # noqa: E402
from .windows import allreduce_windows, send_windows  # noqa: E402


def plot_windows(events: Mapping[int, Sequence[Event]], path: Path, title: str = "") -> Path:
    """Per rank: mean P2P send window, mean all-reduce window, live activations."""
    ranks = sorted(events)
    by_src: dict[int, list[float]] = defaultdict(list)
    for w in send_windows(events):
        by_src[w.src].append(w.window_s)
    p2p = [fmean(by_src[r]) * 1e3 if by_src[r] else 0.0 for r in ranks]
    ar = [fmean(ws) * 1e3 if (ws := allreduce_windows(events[r])) else 0.0 for r in ranks]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].bar(ranks, p2p, color="#8C8C8C")
    axes[0].set(xlabel="sending rank", ylabel="ms", title="mean P2P send window")
    axes[1].bar(ranks, ar, color="#C44E52")
    axes[1].set(xlabel="rank", ylabel="ms", title="mean all-reduce window")
    for r in ranks:
        steps = trace_live_slots(events[r])
        if steps:
            axes[2].step([t for t, _ in steps], [n for _, n in steps], where="post",
                         label=f"rank {r}", linewidth=1)
    axes[2].set(xlabel="time (s)", ylabel="stored activations (microbatch x chunk)",
                title="live activations")
    if len(ranks) <= 8:
        axes[2].legend(fontsize=7)
    fig.suptitle(title or "MegaDPP windows")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_traversal(ax: plt.Axes, order: Sequence[tuple[int, int]], microbatches: int,
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
