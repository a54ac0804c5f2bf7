"""A job simulated in parts: data-parallel replicas split between workers
(processes here, or Ray actors on other machines), the data-parallel
collectives joined.

Point-to-point flows never leave a pipeline and tensor- and model-parallel
groups never leave a replica, so a part that holds whole replicas runs on
its own (``sim.kernel_run.KernelRun`` over its pipelines) until every rank
it could move waits at a collective whose other members are elsewhere. The
parts then stop and say which of those rendezvous have every member of
theirs, and the latest arrival; a rendezvous that every part has is
complete at the latest of those (each part ends it itself: every part holds
the ring's random stream and draws from it in the same order). When no
rendezvous is complete, each part may still take what is due up to the
earliest instant due anywhere (whatever resumes a waiting rank follows from
something due then or later). The parts' times, put side by side, are the
whole job's, bit for bit (``tests/test_sim_partition.py``).
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from megatronapp.program.compiled import CompiledRun
from megatronapp.run.jobs import compile_static
from megatronapp.scenario.config import Scenario, parse_scenario

from .cluster import build_cluster
from .engine import CompiledDeadlock
from .kernel_run import Awaited, KernelRun, kernel_prices
from .symmetry import PipeClasses


@dataclass(frozen=True)
class Report:
    """What a part says when it stops: done, or the rendezvous it awaits and
    the earliest instant due in it."""

    done: bool
    awaited: tuple[Awaited, ...]
    next_due: float


class Part:
    """The pipelines of replicas ``first`` to ``last`` - 1 of a scenario (given
    as its data, so that a worker elsewhere builds it)."""

    def __init__(self, scenario: dict[str, Any], first: int, last: int):
        s = parse_scenario(scenario)
        cluster = build_cluster(s)
        if not kernel_prices(cluster):
            raise ValueError("a part prices no slow link with an onset or an end")
        program = compile_static(s)
        if program is None:
            raise ValueError("only a static schedule runs in parts")
        tp = cluster.topo.tp
        self.pipes = tuple(range(first * tp, last * tp))
        classes = PipeClasses(cluster.topo, tuple((p,) for p in self.pipes))
        self.run = KernelRun(cluster, program, classes, None, s.cluster.gpu.op_overhead_us * 1e-6)

    def advance(self, complete: Sequence[tuple[Any, int, float]], horizon: float) -> Report:
        """End the rendezvous ``complete`` (key, n-th, latest arrival anywhere), then go on."""
        for key, nth, latest in complete:
            self.run.complete(key, nth, latest)
        awaited = self.run.advance(horizon)
        if awaited is None:
            self.run.check_done()
            return Report(True, (), np.inf)
        return Report(False, tuple(awaited), self.run.next_due())

    def process(self) -> int:
        """The id of the process it runs in."""
        return os.getpid()

    def times(self) -> tuple[tuple[int, ...], list[tuple[np.ndarray, ...]], list[tuple[np.ndarray, ...]]]:
        """Its pipelines and, per pipeline, each stage's starts and ends."""
        result = self.run.result()
        return self.pipes, list(result.starts), list(result.ends)


class PartHandle(Protocol):
    """A part wherever it runs: ``call(name, *args)`` returns a pending result,
    ``get`` waits for a list of them."""

    def call(self, name: str, *args: Any) -> Any: ...


@dataclass
class _Local:
    part: Part

    def call(self, name: str, *args: Any) -> Any:
        return getattr(self.part, name)(*args)


def replica_ranges(dp: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` ranges of whole replicas, as even as can be."""
    if not 1 <= parts <= dp:
        raise ValueError(f"parts must be between 1 and dp ({dp}), got {parts}")
    cuts = [dp * k // parts for k in range(parts + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def run_in_parts(s: Scenario, parts: int,
                 start: Callable[[dict[str, Any], int, int], PartHandle] | None = None,
                 gather: Callable[[list[Any]], list[Any]] = list) -> CompiledRun:
    """Simulate ``s`` in ``parts`` parts (``start`` makes each one: in this
    process by default; ``gather`` waits for the pending results of a round)."""
    data = s.model_dump(mode="json")
    make = start or (lambda d, a, b: _Local(Part(d, a, b)))
    handles = [make(data, a, b) for a, b in replica_ranges(s.parallel.dp_cp, parts)]
    complete: list[tuple[Any, int, float]] = []
    horizon = -np.inf
    while True:
        reports: list[Report] = gather([h.call("advance", complete, horizon) for h in handles])
        if all(r.done for r in reports):
            break
        complete, horizon = _joined(reports)
    return _assembled(s, gather([h.call("times") for h in handles]))


def _joined(reports: list[Report]) -> tuple[list[tuple[Any, int, float]], float]:
    """The rendezvous every part awaits, each at its latest arrival anywhere (in
    a fixed order: a ring draws for its collectives in their order), and the
    horizon up to which each part may go on meanwhile."""
    latest: dict[tuple[Any, int], float] = {}
    count: dict[tuple[Any, int], int] = {}
    for r in reports:
        for a in r.awaited:
            k = (a.key, a.nth)
            latest[k] = max(latest.get(k, -np.inf), a.latest)
            count[k] = count.get(k, 0) + 1
    ready = sorted((k for k, n in count.items() if n == len(reports)),
                   key=lambda k: (repr(k[0]), k[1]))
    if ready:
        return [(key, nth, latest[(key, nth)]) for key, nth in ready], -np.inf
    horizon = min(r.next_due for r in reports)
    if horizon == np.inf:  # nothing due anywhere and no rendezvous complete
        raise CompiledDeadlock({})
    return [], horizon


def _assembled(s: Scenario, parts: list[tuple[tuple[int, ...], list[Any], list[Any]]]
               ) -> CompiledRun:
    """One run of every pipeline from the parts' times."""
    topo = build_cluster(s).topo
    program = compile_static(s)
    assert program is not None
    starts: list[Any] = [None] * (topo.dp * topo.tp)
    ends: list[Any] = [None] * (topo.dp * topo.tp)
    for pipes, part_starts, part_ends in parts:
        for pipe, a, b in zip(pipes, part_starts, part_ends):
            starts[pipe], ends[pipe] = a, b
    return CompiledRun(program, topo, tuple((p,) for p in range(len(starts))), tuple(starts),
                       tuple(ends))


def on_ray(address: str) -> tuple[Callable[[dict[str, Any], int, int], PartHandle],
                                  Callable[[list[Any]], list[Any]]]:
    """``start`` and ``gather`` for ``run_in_parts`` with each part a Ray actor
    on the cluster at ``address`` (connected here; ``ray.shutdown`` is the caller's)."""
    import ray

    from megatronapp.host.executors import PACKAGES

    if not ray.is_initialized():
        modules = [importlib.import_module(p) for p in PACKAGES]  # shipped to the workers
        ray.init(address=address, log_to_driver=False, runtime_env={"py_modules": modules})
    actor = ray.remote(Part)

    @dataclass
    class _OnRay:
        handle: Any

        def call(self, name: str, *args: Any) -> Any:
            return getattr(self.handle, name).remote(*args)

    return (lambda d, a, b: _OnRay(actor.remote(d, a, b))), ray.get
