"""How the feature modules (MegaFBD, MegaDPP, MegaScope, MegaScan) plug into
``megatronapp run``: the core defines the hooks, each feature fills in the ones
it needs in its own ``hooks`` module, and ``feature_hooks`` loads them by name,
so the run path (``megatronapp.run``) imports no feature.

``FEATURES`` is the one list of features the run path consults, in the order
their hooks are asked.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..parallel.ops import RankProgram
from ..scenario.config import Scenario
from ..trace.columns import EventSource
from ..trace.events import RunResult
from ..trace.summary_file import RunSummary
from ..trace.totals import BatchTotals
from .ranks import CapturePricing, StagesFor

FEATURES = ("megatronapp.fbd.hooks", "megatronapp.dpp.hooks", "megatronapp.scope.hooks")

Programs = dict[int, RankProgram]
Simulate = Callable[[Scenario], RunResult]  # the simulator, for what-if runs of a variant
ProgramBuilder = Callable[[Scenario, "StagesFor | None", "CapturePricing | None"], Programs]


def _accept(_s: Scenario) -> None:
    return None


def _no_builder(_s: Scenario) -> ProgramBuilder | None:
    return None


def _no_capture(_s: Scenario) -> CapturePricing | None:
    return None


def _no_sections(_s: Scenario, _result: RunResult, _source: EventSource) -> dict[str, Any]:
    return {}


def _no_totals(_s: Scenario, _result: RunResult, _source: EventSource) -> BatchTotals | None:
    return None


def _same_truth(_result: RunResult, truth: dict[str, Any]) -> dict[str, Any]:
    return truth


def _as_simulated(_s: Scenario, _simulate: Simulate, result: RunResult) -> RunResult:
    return result


def _no_headline(_summary: RunSummary) -> list[str] | None:
    return None


def _no_lines(_summary: RunSummary, _out: Path) -> list[str]:
    return []


@dataclass(frozen=True)
class FeatureHooks:
    """What one feature adds to a run; a hook left at its default adds nothing."""

    # refuse a static schedule before its programs are built (MegaDPP: its memory)
    check_static: Callable[[Scenario], None] = _accept
    # the builder of every rank's program for the scenarios the feature owns (MegaDPP: adaptive)
    programs: Callable[[Scenario], ProgramBuilder | None] = _no_builder
    # the price of the scenario's observations, passed to every program (MegaScope)
    capture: Callable[[Scenario], CapturePricing | None] = _no_capture
    # what a simulated run adds to its result, simulating variants of the scenario if it must
    # (MegaScope: the predicted overhead of its captures)
    simulated: Callable[[Scenario, Simulate, RunResult], RunResult] = _as_simulated
    # sections appended to summary.json (MegaDPP: pipeline windows and peak memory)
    summary_sections: Callable[[Scenario, RunResult, EventSource], dict[str, Any]] = _no_sections
    # sections accumulated from the run's batches of whole pipelines, read once for all
    # (MegaDPP: pipeline windows and peak memory), appended after the feature's summary_sections
    summary_totals: Callable[[Scenario, RunResult, EventSource], BatchTotals | None] = _no_totals
    # ground_truth.json as the feature's runs need it (MegaFBD: worker threads, not ranks)
    ground_truth: Callable[[RunResult, dict[str, Any]], dict[str, Any]] = _same_truth
    # the head of what `run` prints, in place of the pipeline's (MegaFBD: devices and roles)
    headline: Callable[[RunSummary], list[str] | None] = _no_headline
    # lines `run` prints after the losses (MegaScope: its capture or predicted overhead)
    lines: Callable[[RunSummary, Path], list[str]] = _no_lines


def feature_hooks(modules: tuple[str, ...] | None = None) -> tuple[FeatureHooks, ...]:
    """The ``HOOKS`` of each named feature module (``FEATURES`` by default),
    imported on first use."""
    hooks: list[FeatureHooks] = [importlib.import_module(name).HOOKS
                                 for name in (FEATURES if modules is None else modules)]
    return tuple(hooks)


def capture_of(s: Scenario, hooks: tuple[FeatureHooks, ...]) -> CapturePricing | None:
    """The first feature's price of observing ``s``, if one observes it."""
    return next((c for c in (h.capture(s) for h in hooks) if c is not None), None)


def builder_of(s: Scenario, hooks: tuple[FeatureHooks, ...]) -> ProgramBuilder | None:
    """The program builder of the feature that owns ``s``, if one does."""
    return next((b for b in (h.programs(s) for h in hooks) if b is not None), None)


def static_schedule(s: Scenario, hooks: tuple[FeatureHooks, ...]) -> bool:
    """Whether every rank runs the static schedule's programs unchanged: no
    feature builds them nor prices observations into them."""
    return builder_of(s, hooks) is None and capture_of(s, hooks) is None
