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
from megatronapp.program.layout import topology_of
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
    stand_in = _stand_ins(s, sorted(set(ranks)))
    costs = _stage_costs(s, sorted(set(stand_in.values())))
    return {r: dict(costs[rep]) for r, rep in stand_in.items() if rep in costs}


@dataclass
class ModelledWork:
    """``modelled_work`` of one scenario, each pipeline stage's worked out
    once: a rank's work depends only on the scenario and its stage, and a
    detector asks batch after batch (an on-line scan: window after window)."""

    scenario: Scenario | None
    _of: dict[int, dict[str, float]] = field(default_factory=dict)
    _asked: set[int] = field(default_factory=set)
    _costs: dict[int, dict[str, float]] = field(default_factory=dict)  # by stand-in rank

    def __call__(self, ranks: Iterable[int]) -> dict[int, dict[str, float]]:
        wanted = sorted(set(ranks))
        new = [r for r in wanted if r not in self._asked]
        if new:
            self._asked.update(new)
            stand_in = _stand_ins(self.scenario, new)
            missing = sorted(set(stand_in.values()) - self._costs.keys())
            self._costs.update(_stage_costs(self.scenario, missing))
            self._of.update({r: self._costs[rep] for r, rep in stand_in.items()
                             if rep in self._costs})
        return {r: self._of[r] for r in wanted if r in self._of}


def _stand_ins(s: Scenario | None, ranks: list[int]) -> dict[int, int]:
    """Each rank's stand-in: every pipeline of a static schedule runs the same
    program (``run.jobs.compile_programs``), so a rank's ops are pipeline 0's
    rank's at its stage; none where the programs do not say."""
    if s is None or s.fbd is not None or s.schedule == "adaptive" or not ranks:
        return {}
    try:
        topo = topology_of(s)
    except (UserError, ScenarioError):
        return {}
    # pipeline 0 (``compiled.pipe_ranks``): data-parallel and tensor-parallel index 0
    return {r: topo.rank(0, topo.stage(r), 0) for r in ranks if 0 <= r < topo.world_size}


def _stage_costs(s: Scenario | None, stand_ins: list[int]) -> dict[int, dict[str, float]]:
    """The stand-ins' mean modelled cost per op name (MegaScope's capture is
    not modelled), their programs recorded in one pass."""
    if s is None or not stand_ins:
        return {}
    try:
        ops = static_compute_ops(s, stand_ins)
    except (NotStatic, UserError, ScenarioError):
        return {}
    return {r: _mean_costs(v) for r, v in ops.items()}


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
