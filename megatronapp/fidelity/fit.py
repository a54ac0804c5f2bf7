"""Fitting a scenario's constants so that simulated iteration times match measured ones.

Iteration time is close to linear in the efficiency model's constants (it is a
max-plus combination of durations that are linear in them), so Gauss-Newton
with finite-difference slopes converges in a few steps; each step simulates
every target scenario once per constant plus once at the current point.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ..scenario.config import Scenario, apply_overrides, parse_scenario, scenario_to_dict

SimulateTime = Callable[[Scenario], float]  # a backend's iteration time, handed in


def with_settings(s: Scenario, settings: Mapping[str, Any]) -> Scenario:
    """``s`` with dotted keys set (validated like ``--set``)."""
    plain = {k: v.item() if hasattr(v, "item") else v for k, v in settings.items()}
    return parse_scenario(apply_overrides(scenario_to_dict(s), [
        f"{k}=null" if v is None else f"{k}={v!r}" for k, v in plain.items()]))


@dataclass(frozen=True)
class Knob:
    """A constant to fit: a dotted scenario key, its start, and its bounds."""

    key: str
    start: float
    low: float
    high: float


@dataclass(frozen=True)
class FitResult:
    values: dict[str, float]
    residuals: tuple[float, ...]  # relative: simulated / measured - 1, per target
    steps: int


BACKTRACKS = 4  # halvings of a Gauss-Newton step that made the fit worse


def _backtracked(x: np.ndarray, err: np.ndarray, delta: np.ndarray, knobs: Sequence[Knob],
                 errors: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The step, halved while it raises the squared error (wave quantisation and
    the schedule's max-plus make the times only piecewise linear in the constants)."""
    low, high = [k.low for k in knobs], [k.high for k in knobs]
    for _ in range(BACKTRACKS):
        x_new = np.clip(x + delta, low, high)
        err_new = errors(x_new)
        if np.sum(err_new ** 2) <= np.sum(err ** 2):
            break
        delta = delta / 2
    return x_new, err_new


Mapper = Callable[[SimulateTime, list[Scenario]], Iterable[float]]  # map, or a pool's


def fit_constants(targets: Sequence[tuple[Scenario, float]], knobs: Sequence[Knob],
                  simulate: SimulateTime, steps: int = 6, tol: float = 1e-4,
                  progress: Callable[[str], None] | None = None,
                  mapper: Mapper = map) -> FitResult:
    """Least squares on relative errors; needs at least as many targets as knobs.
    ``mapper`` runs the simulations of a step (every target at the point and at
    each knob's probe) together, so a process pool's map spreads them."""
    if len(targets) < len(knobs):
        raise ValueError(f"{len(knobs)} constants need at least as many measured runs, "
                         f"got {len(targets)}")
    x = np.array([k.start for k in knobs], dtype=float)

    def errors_at(points: Sequence[np.ndarray]) -> list[np.ndarray]:
        scenarios = [with_settings(s, {k.key: float(v) for k, v in zip(knobs, point)})
                     for point in points for s, _ in targets]
        times = np.array(list(mapper(simulate, scenarios))).reshape(len(points), len(targets))
        return [row / np.array([measured for _, measured in targets]) - 1.0 for row in times]

    def errors(point: np.ndarray) -> np.ndarray:
        return errors_at([point])[0]

    err = errors(x)
    step = 0
    for step in range(1, steps + 1):
        if progress:
            progress(f"fit step {step}: max error {np.max(np.abs(err)) * 100:.2f}%")
        probes, hs = [], []
        for j, knob in enumerate(knobs):
            hs.append(1e-3 * max(abs(x[j]), 1e-3 * (knob.high - knob.low)))
            probe = x.copy()
            probe[j] += hs[-1]
            probes.append(probe)
        jac = np.column_stack([(e - err) / h for e, h in zip(errors_at(probes), hs)])
        delta = np.linalg.lstsq(jac, -err, rcond=None)[0]
        x_new, err_new = _backtracked(x, err, delta, knobs, errors)
        converged = np.max(np.abs(x_new - x) / np.maximum(np.abs(x), 1e-12)) < tol
        x, err = x_new, err_new
        if converged or np.max(np.abs(err)) < tol:
            break
    return FitResult({k.key: float(v) for k, v in zip(knobs, x)}, tuple(map(float, err)), step)
