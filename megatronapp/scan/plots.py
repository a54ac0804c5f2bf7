"""MegaScan's plots: a rank x op heat map of mean durations (MegaScale Fig. 7
style) and an enhanced Marey graph of one iteration of one pipeline."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from megatronapp.trace.timeline import COLOURS  # noqa: E402

from .load import RankEvents  # noqa: E402


def mean_durations(events: RankEvents) -> tuple[list[int], list[str], np.ndarray]:
    """ranks, op names, matrix of mean duration in ms (NaN where a rank lacks the op)."""
    sums: dict[tuple[int, str], list[float]] = defaultdict(list)
    for rank, evs in events.items():
        for e in evs:
            sums[(rank, e.name)].append(e.dur_s)
    ranks = sorted(events)
    names = sorted({name for _, name in sums})
    grid = np.full((len(ranks), len(names)), np.nan)
    for i, r in enumerate(ranks):
        for j, n in enumerate(names):
            if (r, n) in sums:
                grid[i, j] = 1e3 * float(np.mean(sums[(r, n)]))
    return ranks, names, grid


def plot_heatmap(events: RankEvents, path: Path, title: str = "") -> Path:
    """Colour = mean duration relative to that op's median over ranks, so a
    slow rank shows up as a bright row whatever the op's absolute length."""
    ranks, names, grid = mean_durations(events)
    # log2 on a diverging scale clipped at 2x either way: a 1.3x compute row
    # must not be washed out by a victim's 7x longer collective waits.
    with np.errstate(divide="ignore", invalid="ignore"):
        relative = np.log2(grid / np.nanmedian(grid, axis=0, keepdims=True))
    fig, ax = plt.subplots(figsize=(1.2 * len(names) + 3, min(0.22 * len(ranks) + 2, 14)))
    im = ax.imshow(relative, aspect="auto", cmap="coolwarm", interpolation="nearest",
                   vmin=-1.0, vmax=1.0)
    ax.set_xticks(range(len(names)), names, rotation=40, ha="right")
    step = max(1, len(ranks) // 40)
    ax.set_yticks(range(0, len(ranks), step), [str(r) for r in ranks[::step]])
    ax.set_ylabel("rank")
    fig.colorbar(im, ax=ax, label="log2(mean duration / median over ranks)")
    ax.set_title(title or "mean op duration per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pipeline_of(events: RankEvents, start: int | None = None) -> list[int]:
    """Ranks of one pipeline in stage order, following send_forward peers."""
    nxt: dict[int, int] = {}
    receivers: set[int] = set()
    for rank, evs in events.items():
        for e in evs:
            if e.name == "send_forward" and e.args.get("peer") in events:  # a rank we have
                nxt.setdefault(rank, int(e.args["peer"]))
                receivers.add(int(e.args["peer"]))
    first = start if start is not None else min((r for r in events if r not in receivers),
                                                default=min(events))
    order = [first]
    while nxt.get(order[-1]) is not None and nxt[order[-1]] not in order:
        order.append(nxt[order[-1]])
    return order


def plot_marey(events: RankEvents, path: Path, iteration: int = 0, title: str = "") -> Path:
    """Time runs right, pipeline stages run down. Each microbatch's forward
    (and backward) is a line through the stages; compute is a thick segment
    at its stage, the slanted parts between stages are the transfers and
    waits, so a slow stage shows as steep, long segments on one row."""
    stages = pipeline_of(events)
    fig, ax = plt.subplots(figsize=(14, 0.6 * len(stages) + 2))
    t0 = min((e.start_s for r in stages for e in events[r] if e.args.get("iteration") == iteration),
             default=0.0)
    paths: dict[tuple[str, int, int], list[tuple[float, float, int]]] = defaultdict(list)
    for row, rank in enumerate(stages):
        for e in events[rank]:
            if e.args.get("iteration") != iteration or e.name not in ("forward", "backward"):
                continue
            key = (e.name, int(e.args.get("microbatch", 0)), int(e.args.get("chunk", 0)))
            paths[key].append(((e.start_s - t0) * 1e3, (e.end_s - t0) * 1e3, row))
            ax.plot([(e.start_s - t0) * 1e3, (e.end_s - t0) * 1e3], [row, row], lw=6,
                    color=COLOURS[e.name], solid_capstyle="butt")
    for (name, _, _), pts in paths.items():
        pts.sort(key=lambda p: p[0])
        xs = [x for s, e, _ in pts for x in (s, e)]
        ys = [r for _, _, r in pts for _ in (0, 1)]
        ax.plot(xs, ys, lw=0.8, color=COLOURS[name], alpha=0.7)
    ax.set_yticks(range(len(stages)), [f"stage {i} (rank {r})" for i, r in enumerate(stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time in iteration (ms)")
    ax.set_title(title or f"Marey graph, iteration {iteration}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_hook(run_dir: Path, events: RankEvents) -> list[Path]:
    """Extra plots for ``megatronapp plot``."""
    out = [plot_heatmap(events, run_dir / "scan_heatmap.png", title=f"{run_dir.name}: mean op time")]
    if any(e.name == "send_forward" for evs in events.values() for e in evs):
        out.append(plot_marey(events, run_dir / "scan_marey.png", title=f"{run_dir.name}: Marey graph"))
    return out
