"""``sweep --report``: the sweep's table as one self-contained HTML page —
for each swept key, how often MegaScan named the injected fault first and the
iteration time, against the key's value (other keys and seeds pooled)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from ..io.html_page import grid_table, inline_png, page, section, table
from ..trace.timeline import DPI

MAX_LEVELS = 12  # more distinct values than this (random draws) are binned
BINS = 8


@dataclass(frozen=True)
class Level:
    """Runs whose key fell at one value (or in one bin of drawn values)."""
    label: str
    x: float | None  # None for a value that is not a number
    runs: int
    named: int | None  # runs whose first root cause was the injected fault
    mean_ms: float
    low_ms: float
    high_ms: float


def levels(rows: Sequence[Mapping[str, Any]], key: str, detect: bool) -> list[Level]:
    values = [r[key] for r in rows]
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if numeric and len(set(values)) > MAX_LEVELS:
        return _binned(rows, key, detect)
    if numeric:
        return [_level(str(float(f"{v:.4g}")) if isinstance(v, float) else str(v), float(v),
                       [r for r in rows if r[key] == v], detect) for v in sorted(set(values))]
    labels = [_text(v) for v in values]  # a grid over lists or mappings: by their text
    return [_level(label, None, [r for r, own in zip(rows, labels) if own == label], detect)
            for label in sorted(set(labels))]


def _text(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, default=str)
    return str(value)


def _binned(rows: Sequence[Mapping[str, Any]], key: str, detect: bool) -> list[Level]:
    x = np.array([float(r[key]) for r in rows])
    edges = np.linspace(x.min(), x.max(), BINS + 1)
    which = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, BINS - 1)
    out = []
    for b in range(BINS):
        members = [r for r, w in zip(rows, which) if w == b]
        if members:
            label = f"{edges[b]:.4g}–{edges[b + 1]:.4g}"
            out.append(_level(label, float((edges[b] + edges[b + 1]) / 2), members, detect))
    return out


def _level(label: str, x: float | None, rows: Sequence[Mapping[str, Any]],
           detect: bool) -> Level:
    ms = np.array([r["iteration_time_s"] * 1e3 for r in rows])
    named = sum(1 for r in rows if r.get("named_first")) if detect else None
    return Level(label, x, len(rows), named, float(ms.mean()), float(ms.min()), float(ms.max()))


def key_figure(key: str, found: list[Level]) -> Figure:
    detect = found[0].named is not None
    fig = Figure(figsize=(9, 3.4), layout="constrained")
    axes = fig.subplots(1, 2 if detect else 1, squeeze=False)[0]
    numeric = all(lv.x is not None for lv in found)
    xs = [lv.x if numeric and lv.x is not None else i for i, lv in enumerate(found)]
    if detect:
        rate = [(lv.named or 0) / lv.runs for lv in found]
        ax = axes[0]
        ax.plot(xs, rate, marker="o", color="#D62728", label="injected fault named first")
        for x, r, lv in zip(xs, rate, found):
            ax.annotate(f"{lv.named}/{lv.runs}", (x, r), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=8)
        ax.set(xlabel=key, ylabel="detection rate (fraction of runs)", ylim=(-0.05, 1.15),
               title="MegaScan: injected fault named first")
        ax.legend(loc="lower right")
    ax = axes[-1]
    mean = np.array([lv.mean_ms for lv in found])
    spread = np.array([[lv.mean_ms - lv.low_ms for lv in found],
                       [lv.high_ms - lv.mean_ms for lv in found]])
    ax.errorbar(xs, mean, yerr=spread, marker="o", capsize=3, color="#4C72B0",
                label="mean (bars: min to max)")
    ax.set(xlabel=key, ylabel="iteration time (ms)", title="iteration time")
    ax.legend(loc="best")
    if not numeric:
        for a in axes:
            a.set_xticks(xs, [lv.label for lv in found])
    return fig


def sweep_html(name: str, keys: Sequence[str], rows: Sequence[Mapping[str, Any]],
               detect: bool) -> str:
    ok = [r for r in rows if not r.get("error")]
    head = {"runs": len(rows), "failed": len(rows) - len(ok), "swept keys": ", ".join(keys),
            "detection": "MegaScan on every run" if detect else "off (detect: false)"}
    parts = [section("sweep", "Sweep", table(head))]
    for i, key in enumerate(keys):
        found = levels(ok, key, detect) if ok else []
        if not found:
            continue
        columns = ["value", "runs", "named first", "mean iteration (ms)"]
        body = inline_png(key_figure(key, found), f"detection rate and iteration time "
                          f"against {key}", DPI) + grid_table(columns, [
            {"value": lv.label, "runs": lv.runs, "named first": lv.named,
             "mean iteration (ms)": round(lv.mean_ms, 3)} for lv in found])
        parts.append(section(f"key-{i}", f"Against {key}", body))
    failed = [r for r in rows if r.get("error")]
    if failed:
        parts.append(section("failed", "Failed points",
                             grid_table(["point", "seed", "error"], failed)))
    return page(f"{name}: megatronapp sweep", "\n".join(parts))
