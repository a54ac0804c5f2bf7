"""From a scenario to one rank program per global rank (backend-agnostic);
the features' programs, checks and observations come through their hooks
(``program.features``)."""
from __future__ import annotations

from ..program.compiled import NotStatic, PipeProgram, compile_pipe, pipe_ranks
from ..program.features import builder_of, capture_of, feature_hooks
from ..scenario.config import Scenario
from ..program.layout import topology_of
from ..parallel.ops import RankProgram
from ..program.ranks import StagesFor, static_programs
from ..parallel.topology import Topology


def compile_programs(programs: dict[int, RankProgram], topo: Topology) -> PipeProgram | None:
    """The programs of pipeline 0 compiled (every pipeline of a job compiles to
    the same program), or None when they are dynamic and keep the generator
    path. Pipeline 0's generators are consumed either way."""
    ranks = pipe_ranks(topo, 0)
    try:
        return compile_pipe([programs[r] for r in ranks], ranks, topo)
    except NotStatic:
        return None


def compile_static(s: Scenario) -> PipeProgram | None:
    if s.schedule == "adaptive":
        return None
    return compile_programs(rank_programs(s), topology_of(s))


def rank_programs(s: Scenario, stages_for: StagesFor | None = None) -> dict[int, RankProgram]:
    """A feature's programs for the scenarios it owns, else the static schedule's
    (after every feature's checks of a static schedule)."""
    hooks = feature_hooks()
    builder = builder_of(s, hooks)
    if builder is None:
        for feature in hooks:
            feature.check_static(s)
        builder = static_programs
    return builder(s, stages_for, capture_of(s, hooks))
