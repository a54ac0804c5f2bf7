"""A sweep spec: a base scenario, a grid and/or random draws over ``--set``
keys, and seeds. Every point is validated before anything runs.

    scenario: throttle.yaml        # relative to the spec file
    seeds: 3                       # 0, 1, 2 (or a list)
    grid:                          # every combination
      faults.0.factor: [1.1, 1.5]
    random:                        # draws from the spec's own seed
      draws: 10
      seed: 0
      keys:
        cluster.jitter.link_sigma: {uniform: [0.0, 0.2]}
        parallel.microbatches: {choice: [8, 16]}
    detect: true                   # also run MegaScan's detector on each point
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..io import gate
from ..io.text import TextError, load_yaml
from ..scenario.config import (ScenarioError, apply_overrides, parse_scenario, read_scenario_data,
                      scenario_to_dict)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Uniform(_Strict):
    uniform: tuple[float, float]


class LogUniform(_Strict):
    loguniform: tuple[float, float] = Field(description="both ends > 0")


class Choice(_Strict):
    choice: list[Any] = Field(min_length=1)


Distribution = Union[Uniform, LogUniform, Choice]


class RandomDraws(_Strict):
    draws: int = Field(ge=1)
    seed: int = 0
    keys: dict[str, Distribution] = Field(min_length=1)


class SpecModel(_Strict):
    scenario: str
    seeds: Union[int, list[int]] = 1
    grid: dict[str, list[Any]] = {}
    random: RandomDraws | None = None
    detect: bool = False
    backend: Literal["sim"] = "sim"


@dataclass(frozen=True)
class Point:
    """One run: its number, the values it sets, its seed and its scenario data."""

    index: int
    values: dict[str, Any]
    seed: int
    scenario: dict[str, Any]


@dataclass(frozen=True)
class SweepSpec:
    name: str
    model: SpecModel
    base: dict[str, Any]  # the scenario with the command line's --set applied

    @property
    def seeds(self) -> list[int]:
        s = self.model.seeds
        return list(range(s)) if isinstance(s, int) else list(s)

    def keys(self) -> list[str]:
        drawn = list(self.model.random.keys) if self.model.random else []
        return list(self.model.grid) + [k for k in drawn if k not in self.model.grid]

    def point_count(self) -> int:
        """How many points ``points`` makes, counted without making them."""
        combos = math.prod(len(values) for values in self.model.grid.values())
        draws = self.model.random.draws if self.model.random else 1
        seeds = self.model.seeds
        return combos * draws * (max(seeds, 0) if isinstance(seeds, int) else len(seeds))

    def points(self) -> list[Point]:
        """Every (grid combination x random draw) x seed, each scenario validated."""
        combos = [dict(zip(self.model.grid, values))
                  for values in itertools.product(*self.model.grid.values())]
        draws = _draws(self.model.random) if self.model.random else [{}]
        points: list[Point] = []
        for values in (dict(**c, **d) for c in combos for d in draws):
            for seed in self.seeds:
                index = len(points)
                data = apply_overrides(self.base, [f"{k}={_yaml(v)}" for k, v in values.items()]
                                       + [f"seed={seed}"])
                data["name"] = f"{self.name}-{index}"
                try:
                    scenario = scenario_to_dict(parse_scenario(data))
                except ScenarioError as err:
                    raise ScenarioError(f"point {index} ({_describe(values)})", str(err)) from None
                points.append(Point(index, values, seed, scenario))
        return points


def _yaml(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _describe(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items()) or "base scenario"


def _draw(dist: Distribution, rng: np.random.Generator) -> Any:
    if isinstance(dist, Uniform):
        return float(rng.uniform(*dist.uniform))
    if isinstance(dist, LogUniform):
        lo, hi = dist.loguniform
        return float(np.exp(rng.uniform(np.log(lo), np.log(hi))))
    return dist.choice[int(rng.integers(len(dist.choice)))]


def _draws(random: RandomDraws) -> list[dict[str, Any]]:
    out = []
    for i in range(random.draws):
        rng = np.random.default_rng([random.seed, i])
        out.append({k: _draw(d, rng) for k, d in random.keys.items()})
    return out


def load_spec(path: str | Path, overrides: list[str] | None = None) -> SweepSpec:
    path = Path(path)
    try:
        data = load_yaml(gate.read_text(path, "", gate.MAX_TEXT_BYTES), str(path))
    except TextError as err:  # a special file, bad bytes, bad YAML, nested too deeply
        raise ScenarioError("SPEC", str(err)) from None
    if not isinstance(data, dict):
        raise ScenarioError("SPEC", f"{path} must hold a mapping (scenario:, and grid: or "
                            "random:), got " + ("nothing" if data is None else type(data).__name__))
    try:
        model = SpecModel.model_validate(data if isinstance(data, dict) else {})
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "spec"
        raise ScenarioError(f"sweep {where}", first["msg"]) from None
    if model.random is not None:
        for key, dist in model.random.keys.items():
            if isinstance(dist, LogUniform) and min(dist.loguniform) <= 0:
                raise ScenarioError(f"sweep random.keys.{key}", "loguniform ends must be > 0")
    scenario_path = (path.parent / model.scenario)
    base = apply_overrides(read_scenario_data(scenario_path), overrides or [])
    name = path.stem
    return SweepSpec(name, model, base)
