"""MegaFBD's part in ``megatronapp run`` (``program.features``): the ground truth
of a decoupled run (its trace's processes are worker threads, its faults'
ranks devices) and the head of what ``run`` prints about it."""
from __future__ import annotations

from typing import Any

from ..program.features import FeatureHooks, Summary
from ..trace.events import RunResult
from .run import summary_lines


def worker_truth(result: RunResult, truth: dict[str, Any]) -> dict[str, Any]:
    """Skewed devices' worker threads are the skewed "ranks" of the trace."""
    if "fbd" not in result.extra:
        return truth
    device_of = result.extra["fbd"]["device_of_worker"]
    skewed = truth["skewed_ranks"]
    return {**truth, "skewed_ranks": [int(w) for w, d in device_of.items() if d in skewed],
            "skewed_devices": skewed, "device_of_pid": device_of}


def decoupled_headline(summary: Summary) -> list[str] | None:
    return summary_lines(summary) if "fbd" in summary else None


HOOKS = FeatureHooks(ground_truth=worker_truth, headline=decoupled_headline)
