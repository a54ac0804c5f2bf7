"""MegaScan's parameters, all of them, each with its meaning and provenance.

The model (``blame``): a suspect is blamed the seconds by which each
iteration would end earlier had it taken its expected time. It is named for
an iteration when it ran ``noise_multiple`` times the noise of its kind of
quantity over its expected time (the spread of the same excess among all
suspects, over all iterations) and its blame is at least ``min_share`` of
the iteration; it is named when that holds in at least ``min_hit_share`` of
the iterations it was seen in; its
confidence is a logistic function of how many noise units its blame holds
(``confidence_slope``, ``confidence_offset``), fitted so that a confidence
of 0.9 is right nine times in ten on the tuning set.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class Params:
    noise_multiple: float = 3.0
    min_share: float = 0.02
    min_hit_share: float = 0.25
    confidence_slope: float = 2.0
    confidence_offset: float = 0.0
    shortlist: int = 16
    capacity: int = 4096

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and value == value and value >= 0):
                raise ValueError(f"{f.name} must be a number >= 0, got {value!r}")
        if self.shortlist < 1 or self.capacity < 1:
            raise ValueError("shortlist and capacity must be >= 1")


# name -> (meaning, where its value comes from)
PROVENANCE: dict[str, tuple[str, str]] = {
    "noise_multiple": (
        "blame must be this many noise units to count in an iteration",
        "to be fitted on the tuning set"),
    "min_share": (
        "blame must also be this share of its iteration to count",
        "to be fitted on the tuning set"),
    "min_hit_share": (
        "a suspect must count in this share of the iterations it was seen in (a fault "
        "recurs; a machine's hiccup hits one iteration)",
        "to be fitted on the tuning set"),
    "confidence_slope": (
        "logistic slope of the confidence in log(noise units of blame)",
        "to be fitted on the tuning set"),
    "confidence_offset": (
        "logistic offset of the confidence",
        "to be fitted on the tuning set"),
    "shortlist": (
        "suspects replayed per batch, most over their expected time first",
        "not fitted: a bound on work (each replay is one pass over the batch)"),
    "capacity": (
        "noise samples kept per kind of suspect (a uniform reservoir)",
        "not fitted: a bound on memory"),
}


def table() -> list[dict[str, Any]]:
    """The parameters as rows: name, default, meaning, provenance."""
    defaults = Params()
    return [{"name": f.name, "value": getattr(defaults, f.name),
             "meaning": PROVENANCE[f.name][0], "provenance": PROVENANCE[f.name][1]}
            for f in fields(Params)]
