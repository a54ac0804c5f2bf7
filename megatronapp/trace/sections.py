"""The typed parts of a ``RunResult`` that only some runs have: a decoupled
(MegaFBD) run's figures, what a real run's training measured, MegaScope's
capture or predicted overhead, a saved checkpoint. Each says which keys it
adds to summary.json, in order (plain dataclasses: values are written as the
backend measured them, nothing is coerced)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Union


@dataclass(frozen=True)
class FbdSection:
    """A decoupled run: its "ranks" are devices and its iterations steady
    periods (they take the place of the pipeline's figures), plus the ``fbd``
    key's details."""

    world_size: int  # physical devices
    iteration_times_s: list[float]
    bubble_fraction: float  # the mean share of the run a device's compute sits idle
    stages: str  # what ran: "analytic" GPT costs in simulation, "gpt" on torch
    virtual: dict[str, int]  # the virtual tp, pp, dp
    forward_tp: int
    steady_iteration_s: float
    useful_tflops_per_device: float
    devices: list[dict[str, Any]]  # per device: role, class, workers, TFLOPS, busy share, memory
    device_of_worker: dict[str, int]  # trace pid (a worker thread) -> its device
    more: dict[str, Any] = field(default_factory=dict)  # the backend's own (coordinator rounds, memory)

    def summary_items(self) -> dict[str, Any]:
        details = asdict(self)
        top = {k: details.pop(k) for k in ("world_size", "iteration_times_s", "bubble_fraction")}
        more = details.pop("more")
        return {**top, "fbd": {**details, **more}}


@dataclass(frozen=True)
class TorchInfo:
    dist_backend: str
    coalesce_p2p: bool
    device: str  # "cuda" or "cpu"


@dataclass(frozen=True)
class TrainingSection:
    """What a real run's training measured."""

    loss_per_iteration: list[float]
    torch: TorchInfo
    grad_norm_per_iteration: list[float] | None = None  # a decoupled run keeps none

    def summary_items(self) -> dict[str, Any]:
        norms = ({} if self.grad_norm_per_iteration is None
                 else {"grad_norm_per_iteration": self.grad_norm_per_iteration})
        return {"loss_per_iteration": self.loss_per_iteration, **norms,
                "torch": asdict(self.torch)}


@dataclass(frozen=True)
class ScopeOverhead:
    """The simulator's answer to "what would capturing cost on this job"."""

    predicted_capture_overhead: float  # mean iteration time with the capture over without, - 1
    iteration_s: float
    iteration_s_without_capture: float
    capture_events: int
    capture_busy_s: float


@dataclass(frozen=True)
class ScopeCapture:
    """What a real run captured, in RUN_DIR/``capture_dir``."""

    rows: int
    raw_tensors: int
    injections: int
    dropped_records: int
    incomplete_rows: int
    capture_dir: str


ScopeSection = Union[ScopeOverhead, ScopeCapture]


def summary_sections(fbd: FbdSection | None, training: TrainingSection | None,
                     scope: ScopeSection | None, checkpoint: str | None,
                     mitigation: dict[str, Any] | None = None,
                     stopped: dict[str, Any] | None = None) -> dict[str, Any]:
    """The keys the sections a run has add to summary.json, in their order."""
    items: dict[str, Any] = {}
    if fbd is not None:
        items.update(fbd.summary_items())
    if training is not None:
        items.update(training.summary_items())
    if scope is not None:
        items["scope"] = asdict(scope)
    if checkpoint is not None:
        items["checkpoint"] = checkpoint
    if mitigation is not None:
        items["mitigation"] = mitigation
    if stopped is not None:
        items["stopped"] = stopped
    return items
