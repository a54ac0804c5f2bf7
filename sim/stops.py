"""A fail-stop fault in a simulated run: the job ends when a rank's process
dies. Nothing runs differently before it, so the run is simulated whole and
cut at the failure: every op that had not ended by then is gone (its peers
block on the dead rank until the job is stopped, NCCL-timeout-like), and the
stop is recorded for the run's summary."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from megatronapp.faults import JobEffects
from megatronapp.trace.classes import kept_rows
from megatronapp.trace.columns import EventColumns
from megatronapp.trace.events import RunResult
from megatronapp.trace.summary import last_end_s, stop_record


def stopped(result: RunResult, effects: JobEffects) -> RunResult:
    """``result`` cut at the first failure, if one falls inside it."""
    stop = effects.stop
    if stop is None or stop[1] >= last_end_s(result):
        return result
    rank, at = stop

    def before(cols: EventColumns) -> np.ndarray:
        return cols.end_s <= at

    cut = kept_rows(result, before)
    return replace(cut, stopped=stop_record(cut, rank, at))
