"""What ``scope serve`` shows: the capture a directory holds, and the checkpoint
live generation runs on.

Accepted: a capture directory (``manifest.json``), a run directory
(``RUN/scope/`` and ``RUN/checkpoint/``) or a ``scope generate`` output
(``OUT/clean/``). A generation capture names its checkpoint in its manifest.
Following (``--follow``, ``followed_source``), a capture still being written
(only its ``parts/``, possibly in the hidden directory a run writes before
it becomes ``RUN``) is accepted too; ``follow.PartsFollower`` reads it as it grows.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...errors import UserError
from ..storage import STATS_SCHEMA, Capture, find_capture


def _checkpoint_dir(root: Path, capture: Capture) -> Path | None:
    named = capture.manifest.get("checkpoint")
    candidates = [root / "checkpoint", root.parent / "checkpoint",
                  *([Path(named)] if isinstance(named, str) else [])]
    return next((c for c in candidates if (c / "checkpoint.json").is_file()), None)


@dataclass(frozen=True)
class Ridges:
    """The per-step distribution of one scalar statistic over every row of a
    step (layers, heads, tokens, microbatches): one histogram per step on
    shared bin edges, for ridgelines."""

    steps: np.ndarray  # (steps,)
    edges: np.ndarray  # (bins + 1,)
    counts: np.ndarray  # (steps, bins)


@dataclass(frozen=True)
class TrainingSeries:
    """Every scalar statistic of a capture averaged per (site, stat, layer, step)
    over microbatches, replicas, heads and tokens, and the rows behind the means.
    Non-finite values are left out (the capture's ``nan_count``/``inf_count``
    statistics count them)."""

    steps: np.ndarray  # (steps,)
    layers: list[int]
    values: dict[tuple[str, str], np.ndarray]  # (site, stat) -> (layers, steps), NaN where absent
    rows: pa.Table  # site, stat, layer, step, value: the finite scalar rows

    @classmethod
    def of(cls, table: pa.Table) -> "TrainingSeries":
        t = table.filter(pc.is_valid(table["value"])).select(["site", "stat", "layer", "step",
                                                              "value"])
        t = t.filter(pc.is_finite(t["value"]))  # one NaN row (no previous token, say) would blank a mean
        g = t.group_by(["site", "stat", "layer", "step"]).aggregate([("value", "mean")])
        steps = np.unique(np.asarray(g["step"], dtype=np.int64))
        layers = sorted({int(x) for x in g["layer"].to_pylist()})
        col = {s: i for i, s in enumerate(steps)}
        row = {layer: i for i, layer in enumerate(layers)}
        values: dict[tuple[str, str], np.ndarray] = {}
        for site, stat, layer, step, v in zip(*(g[c].to_pylist() for c in
                                                ("site", "stat", "layer", "step", "value_mean"))):
            m = values.setdefault((site, stat), np.full((len(layers), len(steps)), np.nan))
            m[row[layer], col[step]] = v
        return cls(steps, layers, values, t)

    def ridges(self, site: str, stat: str, bins: int = 32) -> Ridges:
        """Histograms of ``stat`` at ``site`` per step of the series (empty rows
        for steps without it), on bins spanning all its values."""
        t = self.rows.filter(pc.and_(pc.equal(self.rows["site"], site),
                                     pc.equal(self.rows["stat"], stat)))
        values = np.asarray(t["value"], dtype=np.float64)
        where = np.searchsorted(self.steps, np.asarray(t["step"], dtype=np.int64))
        edges = np.histogram_bin_edges(values, bins) if len(values) else np.linspace(0, 1, bins + 1)
        counts, _, _ = np.histogram2d(where, values, bins=(np.arange(len(self.steps) + 1) - 0.5,
                                                           edges))
        return Ridges(self.steps, edges, counts)

    def names(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for site, stat in sorted(self.values):
            out.setdefault(site, []).append(stat)
        return out


@dataclass(frozen=True)
class ViewSource:
    capture_dir: Path
    manifest: dict[str, Any]
    series: TrainingSeries
    checkpoint_dir: Path | None

    def info(self) -> dict[str, Any]:
        """What the page needs to know about the capture (JSON)."""
        m = self.manifest
        return {"capture": str(self.capture_dir), "source": m.get("source"),
                "scenario": m.get("scenario"), "model": m.get("model"),
                "checkpoint": str(self.checkpoint_dir) if self.checkpoint_dir else None,
                **self.training_info()}

    def training_info(self) -> dict[str, Any]:
        """What changes while a followed run writes: the series, rows, drops."""
        m = self.manifest
        return {"rows": m.get("rows"), "dropped_records": m.get("dropped_records", 0),
                "capture_state": m.get("capture_state", "merged"),
                "injections": m.get("injections", 0), "series": self.series.names(),
                "series_layers": self.series.layers, "steps": len(self.series.steps),
                "last_step": int(self.series.steps[-1]) if len(self.series.steps) else None}


def open_source(path: str | Path) -> ViewSource:
    """The capture and checkpoint under ``path``; ``UserError`` when it is not a capture."""
    root = Path(path)
    capture = Capture(find_capture(root, "CAPTURE_DIR_OR_RUN_DIR"))
    return ViewSource(capture.path, capture.manifest, TrainingSeries.of(capture.stats()),
                      _checkpoint_dir(root, capture))


def followed_source(path: str | Path) -> ViewSource:
    """A capture being written, empty until ``follow.PartsFollower`` fills it; no
    checkpoint (a run writes it last). ``UserError`` when there is nothing to follow."""
    from .follow import followed_capture

    root = Path(path)
    if followed_capture(root) is None:
        raise UserError(f"CAPTURE_DIR_OR_RUN_DIR: {root} has no capture being written "
                        "(no parts/ or scope/parts/ there or in a run writing it, no manifest)")
    return ViewSource(root, {"source": "followed run", "rows": 0, "capture_state": "parts"},
                      TrainingSeries.of(STATS_SCHEMA.empty_table()), None)
