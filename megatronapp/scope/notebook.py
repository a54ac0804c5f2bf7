"""A capture in a notebook: ``megatronapp.scope.open(path)`` (no torch needed).

``path`` is whatever ``scope summary`` takes: a capture directory, a run
directory or a ``scope generate`` output. The tables are the ones ``scope
query`` names (stats, raw_index, injections), as pyarrow tables or pandas
DataFrames; raw tensors (``keep_raw``) come back by name as numpy arrays.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import UserError
from .storage import Capture, find_capture

TABLES = ("stats", "raw_index", "injections")


def _json_rows(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows)


@dataclass(frozen=True)
class CaptureData:
    """The tables and raw tensors of one capture."""

    capture: Capture

    @property
    def path(self) -> Path:
        return self.capture.path

    @property
    def manifest(self) -> dict[str, Any]:
        return self.capture.manifest

    def table(self, name: str) -> pa.Table:
        """``stats``, ``raw_index`` or ``injections`` as a pyarrow table."""
        if name == "stats":
            return self.capture.stats()
        if name == "raw_index":
            return _json_rows(self.capture.raw_index())
        if name == "injections":
            return _json_rows(self.capture.injections())
        raise UserError(f"table: unknown {name!r} (one of {', '.join(TABLES)})")

    def df(self, name: str) -> Any:
        """The same table as a pandas DataFrame."""
        return self.table(name).to_pandas()

    def raw_names(self) -> list[str]:
        return [e["name"] for e in self.capture.raw_index()]

    def raw(self, name: str) -> np.ndarray:
        """A raw tensor by its ``raw_index`` name, e.g. ``step0/dp0/mb0/layer1/resid_post``."""
        entry = next((e for e in self.capture.raw_index() if e["name"] == name), None)
        if entry is None:
            raise UserError(f"raw: no tensor {name!r} in {self.path} "
                            f"({len(self.raw_names())} kept; see raw_names())")
        return self.capture.raw(entry)


def open_capture(path: str | Path) -> CaptureData:
    """The capture under ``path`` (a capture, a run directory or a generate output)."""
    return CaptureData(Capture(find_capture(path)))
