"""What ``scope serve`` shows: the capture a directory holds, and the checkpoint
live generation runs on.

Accepted: a capture directory (``manifest.json``), a run directory
(``RUN/scope/`` and ``RUN/checkpoint/``) or a ``scope generate`` output
(``OUT/clean/``). A generation capture names its checkpoint in its manifest.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...errors import UserError
from ..storage import Capture


def _capture_dir(root: Path) -> Path:
    for candidate in (root, root / "scope", root / "clean"):
        if (candidate / "manifest.json").is_file():
            return candidate
    raise UserError(f"CAPTURE_DIR_OR_RUN_DIR: {root} is not a MegaScope capture "
                    "(no manifest.json, scope/manifest.json or clean/manifest.json)")


def _checkpoint_dir(root: Path, capture: Capture) -> Path | None:
    named = capture.manifest.get("checkpoint")
    candidates = [root / "checkpoint", root.parent / "checkpoint",
                  *([Path(named)] if isinstance(named, str) else [])]
    return next((c for c in candidates if (c / "checkpoint.json").is_file()), None)


@dataclass(frozen=True)
class TrainingSeries:
    """Every scalar statistic of a capture averaged per (site, stat, layer, step)
    over microbatches, replicas, heads and tokens."""

    steps: np.ndarray  # (steps,)
    layers: list[int]
    values: dict[tuple[str, str], np.ndarray]  # (site, stat) -> (layers, steps), NaN where absent

    @classmethod
    def of(cls, table: pa.Table) -> "TrainingSeries":
        t = table.filter(pc.is_valid(table["value"])).select(["site", "stat", "layer", "step",
                                                              "value"])
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
        return cls(steps, layers, values)

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
                "rows": m.get("rows"), "dropped_records": m.get("dropped_records", 0),
                "injections": m.get("injections", 0),
                "series": self.series.names(), "series_layers": self.series.layers,
                "steps": len(self.series.steps),
                "checkpoint": str(self.checkpoint_dir) if self.checkpoint_dir else None}


def open_source(path: str | Path) -> ViewSource:
    """The capture and checkpoint under ``path``; ``UserError`` when it is not a capture."""
    root = Path(path)
    if not root.is_dir():
        raise UserError(f"CAPTURE_DIR_OR_RUN_DIR: {root} is not a directory")
    capture = Capture(_capture_dir(root))
    return ViewSource(capture.path, capture.manifest, TrainingSeries.of(capture.stats()),
                      _checkpoint_dir(root, capture))
