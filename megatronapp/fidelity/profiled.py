"""A torch.profiler (Kineto) trace as a measured run.

A profiled job's compute ranges carry only their names (``record_function``
around each op: forward, backward, optimizer). Calibration needs to know
which iteration, microbatch and chunk each one was; under a static schedule
a rank issues the same operations in the same order every iteration, so the
scenario's rank programs say it: the n-th range named ``forward`` on a rank is
the n-th forward op of its program. A trace that holds a whole number of
iterations (a profiler schedule may keep only the last few) in the program's
order is annotated; anything else is refused, naming the rank.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from ..program.compiled import NotStatic
from ..scenario.config import Scenario, parse_scenario
from ..errors import UserError
from ..program.ranks import static_compute_ops
from ..trace.events import Event

OpMeta = tuple[str, dict[str, Any]]  # (compute op name, its meta) in issue order


def is_profile(path: Path) -> bool:
    """A torch.profiler file, or a directory of them with none of our traces."""
    from ..scan.ingest.kineto import KINETO_SUFFIXES, kineto_files

    if path.is_file():
        return path.name.endswith(KINETO_SUFFIXES)
    ours = (path / "trace.json").is_file() or (path / "trace.parquet").is_file()
    return path.is_dir() and not ours and bool(kineto_files(path))


def load_profile(path: Path) -> dict[int, list[Event]]:
    from ..scan.ingest.kineto import kineto_files, load_kineto
    from ..scan.ingest.load import TraceError

    files = [path] if path.is_file() else kineto_files(path)
    try:
        return dict(load_kineto(files, by_work=False).events)  # the program's own names
    except TraceError as err:
        raise UserError(f"measured: {err}") from None


def one_iteration(s: Scenario) -> dict[int, list[OpMeta]]:
    """rank -> its compute ops in one iteration of the scenario's programs."""
    if s.fbd is not None or s.schedule == "adaptive":
        raise UserError(f"measured: a profiled trace is read against a static schedule; "
                        f"{'MegaFBD' if s.fbd else 'adaptive'} orders its work at run time")
    single = parse_scenario({**s.model_dump(mode="json"), "iterations": 1})
    try:
        return {r: [(op.name, dict(op.meta)) for op in ops]
                for r, ops in static_compute_ops(single).items()}
    except NotStatic as err:
        raise UserError(f"measured: the scenario's programs are not static ({err})") from None


def annotate(events: dict[int, list[Event]], s: Scenario) -> dict[int, list[Event]]:
    """Each compute range given its program op's iteration, microbatch and chunk."""
    programs = one_iteration(s)
    if sorted(events) != sorted(programs):
        raise UserError(f"measured: the trace has ranks {sorted(events)}, the scenario "
                        f"{len(programs)} ranks (0-{len(programs) - 1})")
    return {r: _annotate_rank(r, ev, programs[r]) for r, ev in events.items()}


def _annotate_rank(rank: int, events: list[Event], program: list[OpMeta]) -> list[Event]:
    names = {name for name, _ in program}
    ranges = sorted((i for i, e in enumerate(events) if e.name in names),
                    key=lambda i: events[i].start_s)
    per = len(program)
    if not ranges or len(ranges) % per:
        raise UserError(f"measured: rank {rank} has {len(ranges)} compute ranges named "
                        f"{'/'.join(sorted(names))}; the scenario's program issues {per} per "
                        "iteration")
    out = list(events)
    for n, index in enumerate(ranges):
        name, meta = program[n % per]
        if events[index].name != name:
            raise UserError(f"measured: rank {rank}'s compute range {n} is "
                            f"{events[index].name!r} where the scenario's schedule has "
                            f"{name!r}: the trace does not follow it")
        out[index] = replace(events[index], args={**events[index].args, **meta,
                                                  "iteration": n // per})
    return out
