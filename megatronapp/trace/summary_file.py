"""summary.json: its model, its schema version, and reading it back.

``run`` writes the file as a plain dictionary (``run.write.build_summary``),
with values as measured; readers validate it against ``RunSummary``, so a
malformed file, or one written by a newer megatronapp, is one line naming the
field. Files written before the key existed have no ``schema_version``: they
are version 1, the layout this model describes."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import UserError
from ..io import gate
from ..io.text import TextError

SCHEMA_VERSION = 1  # bump when a reader could misread the new layout
SUMMARY_FILE = "summary.json"


class SummaryError(UserError):
    """A summary.json that does not hold a run's summary (one line, exit 2)."""


class _Section(BaseModel):
    # the backend's own keys (coordinator rounds, memory notes) pass through
    model_config = ConfigDict(extra="allow", frozen=True)


class FbdSummary(_Section):
    stages: str
    virtual: dict[str, int]
    forward_tp: int
    steady_iteration_s: float
    useful_tflops_per_device: float
    devices: list[dict[str, Any]]
    device_of_worker: dict[str, int]


class TorchSummary(_Section):
    dist_backend: str
    coalesce_p2p: bool
    device: str


class RunSummary(_Section):
    """What ``megatronapp run`` writes; each section only in the runs that have it."""

    schema_version: int = Field(1, ge=1)  # absent: written before it existed
    backend: str
    world_size: int = Field(ge=1)
    schedule: str
    iteration_times_s: list[float | None]  # null: not a finite number
    bubble_fraction: float | None
    faults: list[dict[str, Any]]
    fbd: FbdSummary | None = None  # a decoupled run
    loss_per_iteration: list[float | None] | None = None  # a real run
    grad_norm_per_iteration: list[float | None] | None = None
    torch: TorchSummary | None = None
    scope: dict[str, Any] | None = None  # MegaScope's capture or predicted overhead
    checkpoint: str | None = None
    mitigation: dict[str, Any] | None = None  # the closed loop's segments and goodput
    stopped: dict[str, Any] | None = None  # a fail-stop fault ended the run: which, when
    adjustments: list[str] = []
    scenario: dict[str, Any]
    dpp: dict[str, Any] | None = None  # pipeline windows and peak memory
    trace: dict[str, Any] = {}  # what was written: events, trace.json or not

    @field_validator("schema_version")
    @classmethod
    def _readable(cls, version: int) -> int:
        if version > SCHEMA_VERSION:
            raise ValueError(f"version {version} is newer than this megatronapp reads "
                             f"({SCHEMA_VERSION}); upgrade megatronapp to read it")
        return version


def summary_model(data: Any, where: Path | str) -> RunSummary:
    """``data`` (summary.json's content) validated; the first problem is one line."""
    if not isinstance(data, dict):
        raise SummaryError(f"{where}: must hold a JSON object, got {type(data).__name__}")
    try:
        return RunSummary.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "summary"
        raise SummaryError(f"{where}: {field}: {first['msg'].removeprefix('Value error, ')}"
                           ) from None


def read_summary(path: Path) -> RunSummary:
    """A run directory's summary.json (``path``: the file), validated."""
    try:
        data = gate.read_json(path, "")
    except OSError as err:
        raise SummaryError(f"{path}: cannot read it: {err.strerror or err}") from None
    except TextError as err:
        raise SummaryError(str(err)) from None
    return summary_model(data, path)
