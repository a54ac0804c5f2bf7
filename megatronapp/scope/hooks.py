"""MegaScope's part in ``megatronapp run`` (``program.features``): the price of
a scenario's observations in every rank program, the predicted overhead of a
simulated run's captures, and what ``run`` prints about its capture."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..program.features import FeatureHooks, Simulate
from ..scenario.config import Scenario
from ..trace.events import RunResult
from ..trace.summary_file import RunSummary
from .cost import capture_plan, predicted_overhead


def with_predicted_overhead(s: Scenario, simulate: Simulate, result: RunResult) -> RunResult:
    """A simulated run that observes says what observing it would cost."""
    if capture_plan(s) is None:
        return result
    return replace(result, scope=predicted_overhead(s, simulate, result))


def scope_lines(summary: RunSummary, out: Path) -> list[str]:
    if summary.scope is None:
        return []
    from .summary import run_lines  # DuckDB: only for runs that observed

    return run_lines(summary.scope, out)


HOOKS = FeatureHooks(capture=capture_plan, simulated=with_predicted_overhead, lines=scope_lines)
