"""The simulator's one entry point: a scenario in, a ``RunResult`` out.

Decoupled (MegaFBD) scenarios run on ``sim.fbd``; one data-parallel replica
on the SimPy interpreter (``sim.run.run_replica``); everything else on
``sim.run.run_sim`` (the compiled engine where the programs are static).
"""
from __future__ import annotations

from megatronapp.program.backend import RunHooks
from megatronapp.program.features import feature_hooks
from megatronapp.scenario.config import Scenario
from megatronapp.run.jobs import StagesFor
from megatronapp.trace.summary import run_iteration_times
from megatronapp.trace.events import RunResult

from .fbd import run_fbd_scenario
from .run import run_replica, run_sim


def simulate(s: Scenario, hooks: RunHooks = RunHooks(), replica: bool = False,
             stages_for: StagesFor | None = None) -> RunResult:
    """Simulate ``s``; ``replica``: data-parallel replica 0 stands for all (exact
    without faults or jitter; the caller checks that)."""
    hooks.on_phase(f"simulating {s.world_size} ranks")
    if s.fbd is not None:
        return run_fbd_scenario(s, hooks.events)
    if replica:
        return run_replica(s, hooks.events)
    result = run_sim(s, stages_for, progress=hooks.operations, watch=hooks.events)
    for feature in feature_hooks():  # MegaScope: what observing this job would cost
        result = feature.simulated(s, run_sim, result)
    return result


def simulate_iteration_times(s: Scenario, replica: bool = False) -> list[float]:
    """The iteration times ``megatronapp run`` would report for ``s``."""
    return run_iteration_times(simulate(s, replica=replica))
