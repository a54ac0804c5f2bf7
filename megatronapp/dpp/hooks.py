"""MegaDPP's part in ``megatronapp run`` (``program.features``): the programs of
the adaptive schedule, the memory check of static ones, and summary.json's
``dpp`` section."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..program.features import FeatureHooks, ProgramBuilder
from ..scenario.config import Scenario
from ..trace.columns import EventColumns, EventSource
from ..trace.events import RunResult
from ..trace.totals import BatchTotals
from .program import adaptive_programs
from .static_memory import check_memory
from .windows import DppTotals


def adaptive_builder(s: Scenario) -> ProgramBuilder | None:
    return adaptive_programs if s.schedule == "adaptive" else None


class DppSection:
    """summary.json's ``dpp`` key, accumulated from the run's batches."""

    def __init__(self, s: Scenario, source: EventSource):
        self.totals = DppTotals(s, source.stand_ins())

    def add(self, cols: EventColumns, weight: np.ndarray) -> None:
        self.totals.add(cols, weight)

    def finish(self) -> dict[str, Any]:
        return {"dpp": self.totals.finish()}


def dpp_section(s: Scenario, result: RunResult, source: EventSource) -> BatchTotals | None:
    """Pipeline windows and peak memory (MegaFBD runs report their own memory and idle time)."""
    return None if result.fbd is not None else DppSection(s, source)


HOOKS = FeatureHooks(check_static=check_memory, programs=adaptive_builder,
                     summary_totals=dpp_section)
