"""What a run's fault costs: its iteration time against a healthy baseline.

A simulated run's baseline is the same scenario without its faults, simulated
(same seed, so the same noise); a real run's or a trace's is MegaScan's blame
(the iteration at its healthy peers' pace). Where neither exists the page says
that the baseline is unknown, and why."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from megatronapp.errors import UserError
from megatronapp.scan.cli import ms
from megatronapp.trace.events import RunScenario

SIMULATED = "the same scenario without its faults, simulated"
BLAME = "MegaScan's blame: the iteration at its healthy peers' pace"
NO_FAULTS = "the scenario injects no faults"
MEASURABLE = 1e-3  # of the iteration: below it the two runs differ by rounding, not the fault
CheckSize = Callable[[Any], None]  # an estimate -> nothing, or a UserError saying the limit


@dataclass(frozen=True)
class Baseline:
    """The run's mean iteration time and its healthy one (None: unknown, and
    ``source`` says why), with the healthy run's own iterations when simulated."""

    faulty_s: float | None
    healthy_s: float | None
    source: str
    healthy_times_s: tuple[float, ...] = ()
    faults: int = 1  # how many were taken out (root causes, for the blame)

    @property
    def cost_s(self) -> float | None:
        if self.faulty_s is None or self.healthy_s is None:
            return None
        return self.faulty_s - self.healthy_s

    def sentence(self) -> str:
        """``The fault costs 9.3 ms of each 117 ms iteration (7.9%) ...``."""
        cost = self.cost_s
        if self.source == NO_FAULTS:
            return "The scenario injects no faults: its iteration time is the healthy one."
        if cost is None or self.faulty_s is None or self.healthy_s is None:
            return f"The healthy baseline is unknown: {self.source}."
        the, costs = ("The faults", "cost") if self.faults > 1 else ("The fault", "costs")
        without = f"without {'them' if self.faults > 1 else 'it'}, {ms(self.healthy_s)}"
        if cost <= MEASURABLE * self.faulty_s:
            return (f"{the} {costs} no measurable time of each iteration: {ms(self.faulty_s)}; "
                    f"{without} ({self.source}).")
        return (f"{the} {costs} {ms(cost)} of each {ms(self.faulty_s)} iteration "
                f"({100 * cost / self.faulty_s:.3g}%); {without} ({self.source}).")


def mean_finite(values: Sequence[float | None]) -> float | None:
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def healthy_scenario(summary: Mapping[str, Any]) -> Any:
    """The run's scenario with its faults (and the loop that acts on them) taken out."""
    from megatronapp.scenario.config import parse_scenario

    return parse_scenario({**summary["scenario"], "faults": [], "mitigation": None})


def simulated(summary: Mapping[str, Any], run: RunScenario, check: CheckSize,
              say: Callable[[str], None]) -> Baseline:
    """The scenario without its faults, simulated when the limits allow it."""
    from megatronapp.host.limits import estimate_run
    from megatronapp.trace.summary import run_iteration_times

    faulty = mean_finite(summary.get("iteration_times_s", []))
    healthy = healthy_scenario(summary)
    try:
        check(estimate_run(healthy))
    except UserError as err:
        return Baseline(faulty, None, f"not simulated ({err})")
    say("simulating the scenario without its faults")
    times = tuple(run_iteration_times(run(healthy)))
    return Baseline(faulty, mean_finite(times), SIMULATED, times, len(summary["faults"]))


def from_blame(diagnosis: Mapping[str, Any]) -> Baseline:
    """The iteration less the root causes' blame (summed: each is how much sooner
    the iteration would end were that cause at its expected time)."""
    causes = diagnosis.get("root_causes") or []
    if diagnosis.get("healthy") or not causes:
        return Baseline(None, None, "MegaScan names no root cause to take out")
    evidence = [c.get("evidence") or {} for c in causes]
    if not all("blame_s" in e and "iteration_s" in e for e in evidence):
        return Baseline(None, None, "the verdict holds no blame to take out")
    iteration = max(float(e["iteration_s"]) for e in evidence)
    return Baseline(iteration, iteration - sum(float(e["blame_s"]) for e in evidence), BLAME,
                    faults=len(causes))


def baseline_of(summary: Mapping[str, Any] | None, diagnosis: Mapping[str, Any],
                run: RunScenario, check: CheckSize, say: Callable[[str], None]) -> Baseline:
    """A simulated run's healthy twin; a real run's or a trace's blame."""
    if summary is not None and summary.get("backend") == "sim":
        if not summary.get("faults"):
            return Baseline(mean_finite(summary.get("iteration_times_s", [])), None, NO_FAULTS)
        return simulated(summary, run, check, say)
    return from_blame(diagnosis)
