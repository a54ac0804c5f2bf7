"""MegaDPP's part in ``megatronapp run`` (``program.features``): the programs of
the adaptive schedule, the memory check of static ones, and summary.json's
``dpp`` section."""
from __future__ import annotations

from typing import Any

from ..program.features import FeatureHooks, ProgramBuilder
from ..scenario.config import Scenario
from ..trace.columns import EventSource
from ..trace.events import RunResult
from .program import adaptive_programs
from .static_memory import check_memory
from .windows import dpp_summary_source


def adaptive_builder(s: Scenario) -> ProgramBuilder | None:
    return adaptive_programs if s.schedule == "adaptive" else None


def dpp_section(s: Scenario, result: RunResult, source: EventSource) -> dict[str, Any]:
    """Pipeline windows and peak memory (MegaFBD runs report their own memory and idle time)."""
    if result.fbd is not None:
        return {}
    return {"dpp": dpp_summary_source(s, source)}


HOOKS = FeatureHooks(check_static=check_memory, programs=adaptive_builder,
                     summary_sections=dpp_section)
