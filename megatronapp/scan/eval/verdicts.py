"""A detector's verdict on a run against the faults' ground truth: whether it
named what was injected first, anywhere, and with the iterations it hit."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from megatronapp.faults import Truth
from megatronapp.scan.diagnosis import Diagnosis, RootCause

__all__ = ["Verdict", "verdict"]


@dataclass(frozen=True)
class Verdict:
    named_first: bool  # the first root cause names an injected fault (nothing: healthy)
    named: bool  # some root cause does
    iterations: bool | None  # that cause lists the hit iterations; None: none to list, or not listed
    first: str | None  # the first root cause, as ``compute:5`` or ``link:2-7``

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _label(c: RootCause) -> str:
    return f"{c.kind}:{c.rank}" if c.peer is None else \
        f"{c.kind}:{min(c.rank, c.peer)}-{max(c.rank, c.peer)}"


def _lists_iterations(cause: RootCause, truth: Truth) -> bool | None:
    """The iterations the cause was named for (``evidence['iterations_hit']``:
    a list, or "all" it was seen in) against the iterations the fault hit."""
    named = cause.evidence.get("iterations_hit")
    if truth.iterations is None or not (named == "all" or isinstance(named, (list, tuple))):
        return None
    return named != "all" and set(named) == set(truth.iterations)


def verdict(d: Diagnosis, truth: Sequence[Truth]) -> Verdict:
    """``d`` scored against what a detector should name (``Truth.should_name``)."""
    wanted = [t for t in truth if t.should_name is not None]
    causes = d.root_causes
    first = _label(causes[0]) if causes else None
    if not wanted:
        return Verdict(d.healthy, d.healthy, None, first)
    hits = [(c, t) for c in causes for t in wanted if t.matches(c.kind, c.rank, c.peer)]
    named_first = bool(causes) and any(t.matches(causes[0].kind, causes[0].rank, causes[0].peer)
                                       for t in wanted)
    iterations = _lists_iterations(*hits[0]) if hits else None
    return Verdict(named_first, bool(hits), iterations, first)
