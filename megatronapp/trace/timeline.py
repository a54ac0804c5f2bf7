"""Per-rank timeline plot (forward / backward / communication coloured)."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from .kinds import event_kind  # noqa: E402
from .events import Event  # noqa: E402

COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "optimizer": "#55A868",
           "p2p": "#8C8C8C", "collective": "#C44E52", "other": "#937860"}


def colour_of(e: Event) -> str:
    if e.name in COLOURS:
        return COLOURS[e.name]
    cat = event_kind(e.name, e.args)
    return COLOURS.get(cat, COLOURS["other"])


def plot_timeline(events: Mapping[int, Sequence[Event]], path: Path, title: str = "",
                  max_ranks: int = 64) -> Path:
    """One row per rank: compute on the upper half, communication below it."""
    ranks = sorted(events)[:max_ranks]
    t0 = min((e.start_s for r in ranks for e in events[r]), default=0.0)
    fig, ax = plt.subplots(figsize=(14, 0.45 * len(ranks) + 1.5))
    for row, rank in enumerate(ranks):
        for e in events[rank]:
            comm = event_kind(e.name, e.args) != "compute"
            y = row + (0.0 if comm else 0.45)
            ax.broken_barh([(e.start_s - t0, max(e.dur_s, 1e-9))], (y, 0.4),
                           facecolors=colour_of(e), linewidth=0)
    ax.set_yticks([r + 0.45 for r in range(len(ranks))], [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(title or "timeline")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items() if k != "other"],
              loc="upper right", fontsize=8, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
