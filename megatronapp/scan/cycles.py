"""What the trace commands share about a torch.profiler folder as it was read:
its profiling cycles (``--cycle``), the one warning line about ranks the job
had and the folder lacks, and the facts ``--json`` adds about both."""
from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence, TypeVar

from megatronapp.scan.ingest.folders import ALL, EACH, missing_ranks, parse_cycle

if TYPE_CHECKING:  # the readers load numpy: not for --help
    from megatronapp.scan.ingest.load import LoadedTrace

T = TypeVar("T")


def add_cycle_option(parser: argparse.ArgumentParser, each: bool) -> None:
    """``--cycle``: which profiling cycles of a folder that holds several
    (``schedule(..., repeat=N)``) to read; commands that print per cycle
    default to ``each``, those that write one file to ``all``."""
    def cycle(text: str) -> int | str:
        try:
            chosen = parse_cycle(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        if chosen == EACH and not each:
            raise argparse.ArgumentTypeError(f"must be N (1, 2, ...) or {ALL}: this command "
                                             "writes one output")
        return chosen

    parser.add_argument(
        "--cycle", type=cycle, default=EACH if each else ALL, metavar="N|all" + (
            "|each" if each else ""),
        help="a torch.profiler folder with several profiling cycles per rank: read cycle N "
             "(from 1), all merged as consecutive windows" + (", or each on its own" if each
                                                                else ""))


def warn_missing(traces: Iterable[LoadedTrace]) -> None:
    """One line on stderr naming the ranks of the job no file holds."""
    line = _joined(list(traces)).warning()
    if line:
        print(line, file=sys.stderr)


def _joined(traces: Sequence[LoadedTrace]) -> LoadedTrace:
    """The traces' ranks and world size as one (cycles of one folder)."""
    from megatronapp.scan.ingest.load import LoadedTrace

    if len(traces) == 1:
        return traces[0]
    events: dict[int, list[Any]] = {r: [] for t in traces for r in t.events}  # only the ranks matter here
    worlds = [t.world_size for t in traces if t.world_size is not None]
    return LoadedTrace(events, True, traces[0].source, world_size=max(worlds, default=None))


def trace_facts(traces: Sequence[LoadedTrace]) -> dict[str, Any]:
    """``--json``'s word on the job: its world size and the ranks missing."""
    joined = _joined(traces)
    if joined.world_size is None:
        return {}
    return {"world_size": joined.world_size,
            "missing_ranks": missing_ranks(joined.world_size, joined.events)}


def steps_of(trace: LoadedTrace) -> tuple[int, int] | None:
    """The first and last profiler step (iteration) of a trace, if it has any."""
    its = [int(e.args["iteration"]) for evs in trace.events.values() for e in evs
           if "iteration" in e.args]
    return (min(its), max(its)) if its else None


def cycle_heading(trace: LoadedTrace, count: int) -> str:
    steps = steps_of(trace)
    where = f" (profiler steps {steps[0]}-{steps[1]})" if steps else ""
    return f"cycle {', '.join(map(str, trace.cycles))} of {count}{where}:"


def per_cycle_json(results: Sequence[tuple[LoadedTrace, T]], body: Callable[[T], dict[str, Any]]
                   ) -> dict[str, Any]:
    """One cycle: its body as it always was; several: a list of them, each
    with its cycle number and steps. The job's facts beside."""
    facts = trace_facts([t for t, _ in results])
    if len(results) == 1:
        return {**body(results[0][1]), **facts}
    return {"cycles": [{"cycle": t.cycles[0], "steps": steps_of(t), **body(r)}
                       for t, r in results], **facts}


def per_cycle_lines(results: Sequence[tuple[LoadedTrace, T]], lines: Callable[[T], Iterable[str]]
                    ) -> Iterator[str]:
    """The text of each cycle, under a heading where there are several."""
    for trace, result in results:
        if len(results) > 1:
            yield cycle_heading(trace, len(results))
        yield from lines(result)
