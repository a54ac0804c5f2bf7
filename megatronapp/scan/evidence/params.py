"""MegaScan's parameters, all of them, each with its meaning and provenance.

The model (``blame``): a suspect is blamed the seconds by which each
iteration would end earlier had it taken its expected time. It is named for
an iteration when it ran ``noise_multiple`` times the noise of its kind of
quantity over its expected time (the spread of the same excess among the other
suspects, over all iterations) and ``min_slowdown`` of it over, and by the
iteration's end the delay it had caused (its blame summed over the batch's
iterations so far) is at least ``min_share`` of the time the job had run.
It is named when that
holds in every iteration it was seen in, or in so many of them that a
healthy suspect, counting in each by chance with probability
``chance_count``, would do so with probability at most 1% (a persistent
fault: a long trace lets it miss the few iterations the machine's noise hid
it in), or in at least two of them with ``recur_multiple`` noise units each
(an intermittent fault: it recurs, and where it strikes it stands far out,
which a machine's hiccup in one iteration does not); its confidence is a logistic function of how many noise units its blame holds
(``confidence_slope``, ``confidence_offset``), fitted so that a confidence
of 0.9 is right nine times in ten on the tuning set.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class Params:
    noise_multiple: float = 1.5
    min_slowdown: float = 0.1
    min_share: float = 0.003
    recur_multiple: float = 100.0
    confidence_slope: float = 0.526
    confidence_offset: float = 0.576
    shortlist: int = 16
    capacity: int = 64
    min_noise_samples: int = 4
    chance_count: float = 0.35

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            signed = f.name == "confidence_offset"
            if not (isinstance(value, (int, float)) and abs(value) < float("inf")
                    and (signed or value >= 0)):
                raise ValueError(f"{f.name} must be a finite number{'' if signed else ' >= 0'}, "
                                 f"got {value!r}")
        if self.shortlist < 1 or self.capacity < 1 or self.min_noise_samples < 1:
            raise ValueError("shortlist, capacity and min_noise_samples must be >= 1")
        if self.chance_count > 1:
            raise ValueError(f"chance_count must be a probability (<= 1), got {self.chance_count!r}")


FITTED = ("fitted on the tuning set (results/scan_fit.json, python -m "
          "experiments.scan_accuracy --fit --tuning-only): the grid's (scan.eval.tuning.GRID) "
          "point naming the most faults first with false alarms on at most 3% of the healthy runs")
FITTED_CHANCE = ("fitted on the tuning set, the other thresholds held (results/scan_chance.json, "
                 "python -m experiments.scan_accuracy --fit-chance --tuning-only): the value "
                 "naming the most faults first with no more false alarms than counting in every "
                 "iteration; only traces of more than four iterations tell values apart")
CALIBRATED = ("fitted on the tuning set's named causes, the thresholds held (results/"
              "scan_calibration.json, python -m experiments.scan_accuracy --fit-calibration "
              "--tuning-only): the logistic regression of right on log(noise units) with the "
              "highest posterior under a unit Gaussian prior at slope 1, offset 0 "
              "(scan.eval.tuning.fit_calibration)")

# name -> (meaning, where its value comes from)
PROVENANCE: dict[str, tuple[str, str]] = {
    "noise_multiple": (
        "blame must be this many noise units to count in an iteration",
        FITTED),
    "min_slowdown": (
        "and at least this much over its expected time, relative to it (0.5: 1.5x as long)",
        FITTED),
    "min_share": (
        "by the iteration's end, its delay (blame summed over the iterations so far) must "
        "also be this share of the time the job had run, for the iteration to count",
        FITTED),
    "recur_multiple": (
        "a suspect that counts in some of the iterations it was seen in, not all, is named "
        "when it counts in at least two with this many noise units each (an intermittent "
        "fault recurs and stands far out where it strikes; a hiccup hits one iteration)",
        FITTED),
    "confidence_slope": (
        "logistic slope of the confidence in log(noise units of blame)",
        CALIBRATED),
    "confidence_offset": (
        "logistic offset of the confidence",
        CALIBRATED),
    "shortlist": (
        "suspects replayed per batch, most over their expected time first",
        "not fitted: a bound on work (each replay is one pass over the batch)"),
    "capacity": (
        "noise samples kept per suspect (an evenly thinned reservoir): one per iteration "
        "while a run is shorter",
        "not fitted: a bound on memory (98,304 ranks x 64 samples: 50 MB)"),
    "min_noise_samples": (
        "fewest samples a suspect's noise is measured from once it and its one peer are "
        "left out; with fewer, every suspect's samples are used",
        "not fitted: a median absolute deviation of four values is the least that says "
        "anything"),
    "chance_count": (
        "how often a healthy suspect counts in an iteration by chance: a suspect counting in "
        "fewer than all the iterations it was seen in is persistent when a healthy one would "
        "count in as many with probability at most 1%",
        FITTED_CHANCE),
}


def table() -> list[dict[str, Any]]:
    """The parameters as rows: name, default, meaning, provenance."""
    defaults = Params()
    return [{"name": f.name, "value": getattr(defaults, f.name),
             "meaning": PROVENANCE[f.name][0], "provenance": PROVENANCE[f.name][1]}
            for f in fields(Params)]
