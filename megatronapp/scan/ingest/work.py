"""The work a run's compute ops model, to compare pipeline stages that differ.

A job with no tensor- or data-parallel peers leaves MegaScan only the other
pipeline stages to compare a rank with, and those do not do equal work: the
last stage also computes the output layer (on a large vocabulary that can
double its forward), the first one the embedding. The rank programs know
each compute op's modelled cost, so durations divided by it compare stages
on the speed they ran at, not on the work they were given.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from megatronapp.program.compiled import NotStatic
from megatronapp.scenario.config import Scenario, ScenarioError, parse_scenario
from megatronapp.errors import UserError
from megatronapp.parallel.ops import Compute
from megatronapp.program.ranks import static_compute_ops

from megatronapp.scan.ingest.load import read_object

Work = Mapping[int, Mapping[str, float]]  # rank -> compute op name -> mean modelled seconds


def modelled_work(s: Scenario | None, ranks: Iterable[int]) -> dict[int, dict[str, float]]:
    """rank -> op name -> the mean modelled cost of its compute ops of that
    name, for ``ranks``; empty when the scenario's programs do not say (none
    given, MegaFBD's devices, a dynamic schedule)."""
    wanted = sorted(set(ranks))
    if s is None or s.fbd is not None or s.schedule == "adaptive" or not wanted:
        return {}
    try:
        ops = static_compute_ops(s, wanted)  # MegaScope's capture costs are not modelled
        return {r: _mean_costs(ops[r]) for r in wanted if r in ops}
    except (NotStatic, UserError, ScenarioError):
        return {}


@dataclass
class ModelledWork:
    """``modelled_work`` of one scenario, each rank's worked out once: a rank's
    work depends only on the scenario, and an on-line scan asks for the same
    ranks at every window (rebuilding their programs each time)."""

    scenario: Scenario | None
    _of: dict[int, dict[str, float]] = field(default_factory=dict)
    _asked: set[int] = field(default_factory=set)

    def __call__(self, ranks: Iterable[int]) -> dict[int, dict[str, float]]:
        wanted = sorted(set(ranks))
        new = [r for r in wanted if r not in self._asked]
        if new:
            self._of.update(modelled_work(self.scenario, new))
            self._asked.update(new)
        return {r: self._of[r] for r in wanted if r in self._of}


def _mean_costs(ops: Iterable[Compute]) -> dict[str, float]:
    costs: dict[str, list[float]] = defaultdict(list)
    for op in ops:
        if op.cost_s > 0:
            costs[op.name].append(op.cost_s)
    return {name: sum(v) / len(v) for name, v in costs.items()}


def scenario_of_run(run_dir: Path | None) -> Scenario | None:
    """The job a run directory's summary.json records (its layout, model,
    cluster and costs: what its ops should cost), if it validates, without
    its faults: what was injected is for scoring a detector, never its input."""
    summary = run_dir / "summary.json" if run_dir else None
    if summary is None or not summary.is_file():
        return None
    data = read_object(summary).get("scenario")
    if not isinstance(data, dict):
        return None
    try:
        return parse_scenario({k: v for k, v in data.items() if k not in FAULT_KEYS})
    except (ScenarioError, UserError, ValueError):
        return None


# what a scenario says of its faults (the list, and leave to inject faults that touch no data)
FAULT_KEYS = frozenset({"faults", "allow_idle_faults"})


def job_of(s: Scenario | None) -> Scenario | None:
    """``s`` without its faults: the job a detector may know of (its layout,
    model, cluster, costs), never what was injected into it."""
    return s if s is None or not s.faults else s.model_copy(update={"faults": ()})
