"""The simulator as a backend (``--backend sim``): ``sim.simulate`` behind the
``Backend`` protocol."""
from __future__ import annotations

from dataclasses import dataclass

from megatronapp.program.backend import REPLICA, RunHooks, RunOptions
from megatronapp.scenario.config import Scenario
from megatronapp.trace.events import RunResult
from sim import compare_plans, simulate

__all__ = ["SimBackend", "compare_plans"]  # compare_plans: fbd-compare, a simulator-only study


@dataclass(frozen=True)
class SimBackend:
    name: str = "sim"
    capabilities: frozenset[str] = frozenset({REPLICA})

    def run(self, scenario: Scenario, options: RunOptions, hooks: RunHooks) -> RunResult:
        return simulate(scenario, hooks, replica=options.replica)
