"""MegaScope's part in ``megatronapp run`` (``program.features``): the price of
a scenario's observations in every rank program, and what ``run`` prints about
its capture."""
from __future__ import annotations

from pathlib import Path

from ..program.features import FeatureHooks
from ..trace.summary_file import RunSummary
from .cost import capture_plan


def scope_lines(summary: RunSummary, out: Path) -> list[str]:
    if summary.scope is None:
        return []
    from .summary import run_lines  # DuckDB: only for runs that observed

    return run_lines(summary.scope, out)


HOOKS = FeatureHooks(capture=capture_plan, lines=scope_lines)
