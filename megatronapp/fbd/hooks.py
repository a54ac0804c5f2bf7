"""MegaFBD's part in ``megatronapp run`` (``program.features``): the ground truth
of a decoupled run (its trace's processes are worker threads, its faults'
ranks devices) and the head of what ``run`` prints about it."""
from __future__ import annotations

from typing import Any

from ..program.features import FeatureHooks
from ..trace.events import RunResult
from ..trace.summary_file import RunSummary
from .run import summary_lines


def worker_truth(result: RunResult, truth: dict[str, Any]) -> dict[str, Any]:
    """Skewed devices' worker threads are the skewed "ranks" of the trace."""
    if result.fbd is None:
        return truth
    device_of = result.fbd.device_of_worker
    skewed = truth["skewed_ranks"]
    return {**truth, "skewed_ranks": [int(w) for w, d in device_of.items() if d in skewed],
            "skewed_devices": skewed, "device_of_pid": device_of}


def decoupled_headline(summary: RunSummary) -> list[str] | None:
    return summary_lines(summary.model_dump()) if summary.fbd is not None else None


HOOKS = FeatureHooks(ground_truth=worker_truth, headline=decoupled_headline)
