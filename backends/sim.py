"""The simulator as a backend (``--backend sim``): ``sim.simulate`` behind the
``Backend`` protocol."""
from __future__ import annotations

from dataclasses import dataclass

from megatronapp.costs.run_size import RunSize
from megatronapp.program.backend import ESTIMATED, REPLICA, RunHooks, RunOptions
from megatronapp.scenario.config import Scenario
from megatronapp.trace.events import RunResult
from sim import compare_plans, run_size, simulate

__all__ = ["SimBackend", "compare_plans"]  # compare_plans: fbd-compare, a simulator-only study


@dataclass(frozen=True)
class SimBackend:
    name: str = "sim"
    capabilities: frozenset[str] = frozenset({REPLICA, ESTIMATED})

    def run(self, scenario: Scenario, options: RunOptions, hooks: RunHooks) -> RunResult:
        return simulate(scenario, hooks, replica=options.replica)

    def size(self, scenario: Scenario) -> RunSize | None:
        return run_size(scenario)
