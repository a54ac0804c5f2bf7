"""Running a scenario on the simulator: the compiled engine where the rank
programs are static, the SimPy interpreter otherwise; one data-parallel
replica for ``predict --replica``."""
from __future__ import annotations

from typing import Callable

from megatronapp.costs.run_size import RunSize
from megatronapp.program.compiled import CompiledRun, PipeProgram
from megatronapp.trace.columns import RankEventsView
from megatronapp.scenario.config import Scenario
from megatronapp.program.features import feature_hooks, static_schedule
from megatronapp.run.jobs import StagesFor, compile_programs, rank_programs
from megatronapp.trace.events import Event, RunResult

from .cluster import Cluster, build_cluster
from .engine import CompiledDeadlock, run_compiled
from .interpreter import SimDeadlock, SimInterpreter
from .kernel_run import kernel_prices, run_on_kernel
from .stops import stopped
from .symmetry import PipeClasses, identity_classes, pipe_classes


def op_overhead_s(s: Scenario) -> float:
    return s.cluster.gpu.op_overhead_us * 1e-6


def run_sim(s: Scenario, stages_for: StagesFor | None = None,
            on_record: Callable[[int, Event], None] | None = None,
            progress: Callable[[int, int], None] | None = None, engine: str = "auto",
            reduce: bool = True, watch: Callable[[int, Event], None] | None = None) -> RunResult:
    """Simulate a scenario end to end.

    ``engine``: "auto" runs static schedules (with placeholder stages and no
    per-event hook or MegaScope capture) on the compiled event loop
    (``sim.kernel_run``; the reference engine, ``sim.engine``, where the loop
    does not price a job: ``kernel_prices``, e.g. host stalls, link flaps,
    slow links with an onset or an end, a crash), unless a rank
    program is not static (``megatronapp.program.compiled.NotStatic``); anything else
    runs on the SimPy generator path; "reference" forces the reference engine on
    static schedules, "generator" the SimPy path. ``reduce``
    simulates one pipeline per class of identical ones (exact; see ``sim.symmetry``).
    ``watch`` sees each event where the SimPy interpreter runs them (it
    does not choose the engine, unlike ``on_record``).
    """
    cluster = build_cluster(s)
    program = None
    if engine in ("auto", "reference") and stages_for is None and on_record is None:
        program = _compiled_program(s, cluster)
    if program is not None:
        classes = pipe_classes(cluster) if reduce else identity_classes(cluster.topo)
        try:
            run = _run_static(cluster, program, classes, progress, op_overhead_s(s),
                              engine == "reference")
        except CompiledDeadlock as err:
            raise SimDeadlock(err.blocked) from None
        return stopped(RunResult("sim", cluster.topo, RankEventsView(run), cluster.clocks,
                                 source=run), cluster.effects)
    interpreter = SimInterpreter(cluster, on_record or watch, op_overhead_s=op_overhead_s(s))
    events = interpreter.run(rank_programs(s, stages_for))
    return stopped(RunResult("sim", cluster.topo, events, cluster.clocks), cluster.effects)


def _run_static(cluster: Cluster, program: PipeProgram, classes: PipeClasses,
                progress: Callable[[int, int], None] | None, overhead_s: float,
                reference: bool) -> CompiledRun:
    """A static program on the compiled loop, or on the reference engine
    (asked for, or where the loop does not price the job: ``kernel_prices``)."""
    if reference or not kernel_prices(cluster):
        return run_compiled(cluster, program, classes, progress, overhead_s)
    return run_on_kernel(cluster, program, classes, progress, overhead_s)


def _compiled_program(s: Scenario, cluster: Cluster) -> PipeProgram | None:
    """The program the compiled engine runs, or None where the generator path
    runs: a feature builds the programs (adaptive schedules) or prices
    observations into them (MegaScope's captures differ between tensor-parallel
    ranks)."""
    if not static_schedule(s, feature_hooks()):
        return None
    return compile_programs(rank_programs(s), cluster.topo)


def run_size(s: Scenario) -> RunSize | None:
    """What ``run_sim`` will do for ``s``, counted before it runs: the program it
    compiles, the pipelines it simulates (one per class of identical ones) and
    the rows the trace holds; None where the generator path runs (MegaFBD,
    adaptive schedules, MegaScope captures)."""
    if s.fbd is not None:
        return None
    cluster = build_cluster(s)
    program = _compiled_program(s, cluster)
    if program is None:
        return None
    per_pipe, pipes = program.events_per_pipe, cluster.topo.dp * cluster.topo.tp
    classes = pipe_classes(cluster)
    simulated = per_pipe * len(classes.classes)
    return RunSize(ranks=cluster.topo.world_size, program_events=per_pipe,
                   simulated_events=simulated, trace_events=per_pipe * pipes,
                   # a reduced run stores its representatives' rows (``trace.classes``)
                   stored_events=simulated if classes.reduced else per_pipe * pipes)


def replica_ranks(s: Scenario) -> frozenset[int]:
    """The ranks of data-parallel replica 0."""
    topo = build_cluster(s).topo
    return frozenset(r for r in range(topo.world_size) if topo.coord(r).dp == 0)


def run_replica(s: Scenario, on_record: Callable[[int, Event], None] | None = None) -> RunResult:
    """Simulate data-parallel replica 0 only; dp collectives are priced for their
    whole group. Exact for scenarios without faults or jitter (identical replicas)."""
    cluster = build_cluster(s)
    ranks = replica_ranks(s)
    interpreter = SimInterpreter(cluster, on_record, simulated=ranks,
                                 op_overhead_s=op_overhead_s(s))
    programs = rank_programs(s)
    events = interpreter.run({r: programs[r] for r in sorted(ranks)})
    return stopped(RunResult("sim", cluster.topo, events, cluster.clocks), cluster.effects)
