"""Everything about a folder of torch.profiler files as users have them lives here.

A folder holds one file per rank per profiling cycle, named any way
(``rank-0.json.gz``, ``sampled_rank-1.json.gz``, ``host_pid.1700000000.pt.trace.json``):
``tensorboard_trace_handler`` under ``schedule(..., repeat=N)`` writes N files
per rank. Files are grouped into cycles by time: a file joins the cycle whose
window its own overlaps, and a rank with two files of one window is refused
(two traces of the same time cannot both be that rank's). Cycles are chosen
with ``Cycles``: one (``N``, counted from 1), ``all`` merged as consecutive
windows, or ``each`` read on its own. Ranks a file's ``distributedInfo``
says the job had and the folder lacks are named, not guessed.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from megatronapp.scan.errors import TraceError

ALL, EACH = "all", "each"
CYCLE_CHOICES = f"N (1, 2, ...), {ALL} (merged) or {EACH}"


@dataclass(frozen=True)
class FileWindow:
    """What grouping needs of one parsed file: its rank and its time span."""

    path: str
    rank: int
    start_us: float
    end_us: float


def group_cycles(files: Sequence[FileWindow]) -> list[list[int]]:
    """Indices into ``files`` per profiling cycle, in time order; each cycle
    holds at most one file per rank."""
    order = sorted(range(len(files)), key=lambda i: (files[i].start_us, files[i].path))
    cycles: list[list[int]] = []
    bounds: list[tuple[float, float]] = []
    for i in order:
        f = files[i]
        at = next((c for c in range(len(cycles)) if f.start_us <= bounds[c][1]
                   and f.end_us >= bounds[c][0]), None)
        if at is None:
            cycles.append([i])
            bounds.append((f.start_us, f.end_us))
            continue
        twin = next((files[j] for j in cycles[at] if files[j].rank == f.rank), None)
        if twin is not None:
            raise TraceError(f.path, f"rank {f.rank} twice in one profiling cycle: "
                             f"{Path(twin.path).name} covers the same time; keep one of the two "
                             "in the folder (move the other out), or give the file to read")
        cycles[at].append(i)
        bounds[at] = (min(bounds[at][0], f.start_us), max(bounds[at][1], f.end_us))
    return cycles


def parse_cycle(text: str) -> int | str:
    """``--cycle``: a cycle number from 1, ``all`` or ``each``."""
    lowered = text.strip().lower()
    if lowered in (ALL, EACH):
        return lowered
    if lowered.isdigit() and int(lowered) >= 1:
        return int(lowered)
    raise ValueError(f"must be {CYCLE_CHOICES}, got {text!r:.40}")


def chosen_cycles(count: int, choice: int | str, source: str) -> list[list[int]]:
    """Which of the ``count`` cycles of ``source`` to read, in groups read as one."""
    if choice == EACH:
        return [[c] for c in range(count)]
    if choice == ALL:
        return [list(range(count))]
    assert isinstance(choice, int)
    if choice > count:
        raise TraceError(source, f"--cycle {choice}: the folder holds {count} profiling cycle"
                         f"{'s' if count != 1 else ''} (count from 1)")
    return [[choice - 1]]


def missing_ranks(world_size: int | None, present: Iterable[int]) -> list[int]:
    """Ranks of the job (``world_size``) the folder has no file of."""
    if world_size is None:
        return []
    have = set(present)
    return [r for r in range(world_size) if r not in have]


def rank_ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def missing_line(source: str, world_size: int, present: Sequence[int],
                 missing: Sequence[int]) -> str:
    """The one warning line about a partial rank set."""
    return (f"warning: {source} holds {len(present)} of the {world_size} ranks its traces' "
            f"distributedInfo names; missing: {rank_ranges(missing)} (their work and waits are "
            "not judged; collectives are matched among the ranks present)")
