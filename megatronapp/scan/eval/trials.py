"""Validation trials: random jobs with one known injected fault (or none).

Two plans share one shape of answer (a ``Trial`` with its truth) and one
scoring harness (``validate.py``):

- ``SIM`` — simulated jobs of 2-64 ranks, the simulator's own noise.
- ``REAL`` — jobs sized for a small CPU machine (2-4 ranks, one thread each),
  run for real on the torch backend: the machine brings the noise, the
  throttle is a real sleep after each compute and a faulty link a real sleep
  after each receive. Links are priced at a nominal ``REAL_P2P_S`` per
  transfer (``costs.p2p_s``), so a 3x slow link adds twice that per receive.

Every trial also skews a few ranks' clocks (never rank 0, the reference), so
every method sees traces aligned by MegaScan, never the true time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from megatronapp.scenario import seeds
from megatronapp.scenario.config import Scenario, parse_scenario
from megatronapp.parallel.topology import Topology

from megatronapp.scan.diagnosis import RootCause

CONTROLS = ("clock_skew only", "healthy")
MAX_SIM_RANKS = 64
REAL_P2P_S = 0.002  # nominal seconds per pipeline transfer that link faults scale


@dataclass(frozen=True)
class Trial:
    index: int
    band: str
    scenario: Scenario
    truth_rank: int | None  # the throttled rank
    truth_pair: tuple[int, int] | None  # the faulty link


@dataclass(frozen=True)
class TrialPlan:
    """A family of trials: its bands (drawn with equal probability) and maker."""

    name: str
    bands: tuple[str, ...]
    make: Callable[[int, int], Trial]  # (seed, index) -> trial


def matches(cause: RootCause, trial: Trial) -> bool:
    if trial.truth_rank is not None:
        return cause.rank == trial.truth_rank and cause.kind == "compute"
    if trial.truth_pair is not None:
        return cause.peer is not None and {cause.rank, cause.peer} == set(trial.truth_pair)
    return False


def _band_range(band: str) -> tuple[float, float]:
    lo, hi = (float(x) for x in band.split()[1].split("-"))
    return lo, hi


def _fault(band: str, rng: np.random.Generator, topo: Topology,
           ) -> tuple[list[dict], int | None, tuple[int, int] | None]:
    """The band's performance fault (if any), the throttled rank, the faulty pair."""
    if band.startswith("throttle"):
        rank = int(rng.integers(topo.world_size))
        return [{"kind": "throttle", "rank": rank, "factor": float(rng.uniform(*_band_range(band)))}], rank, None
    if band.startswith(("slow_link", "link_jitter")):
        upstream = [r for r in range(topo.world_size) if topo.coord(r).pp < topo.pp - 1]
        a = int(rng.choice(upstream))
        pair = (a, topo.pp_neighbor(a, 1))
        value = float(rng.uniform(*_band_range(band)))
        key = "factor" if band.startswith("slow_link") else "sigma"
        return [{"kind": band.split()[0], "ranks": list(pair), key: value}], None, pair
    return [], None, None


def _clock_skews(rng: np.random.Generator, world: int, count: int) -> list[dict]:
    """Offsets up to ±10 ms and drifts up to ±100 ppm on ``count`` ranks (never rank 0,
    the reference: its skew would only shift the whole timeline)."""
    ranks = rng.choice(np.arange(1, world), size=min(count, world - 1), replace=False)
    return [{"kind": "clock_skew", "rank": int(r), "offset_us": float(rng.uniform(-1e4, 1e4)),
             "drift_ppm": float(rng.uniform(-100, 100))} for r in ranks]


def _skew_count(rng: np.random.Generator, band: str) -> int:
    return int(rng.integers(1, 4)) if band == "clock_skew only" else int(rng.integers(0, 3))


def _is_link_band(band: str) -> bool:
    return band.startswith(("slow_link", "link_jitter"))


# ------------------------------------------------------------- simulated
SIM_BANDS = ("throttle 1.05-1.1", "throttle 1.1-1.2", "throttle 1.2-2", "slow_link 1.5-4",
             "link_jitter 0.3-1", "clock_skew only", "healthy")


def _sim_shape(rng: np.random.Generator, needs_links: bool) -> tuple[int, int, int]:
    while True:
        tp, pp, dp = (int(rng.choice(c)) for c in ((1, 2, 4), (1, 2, 4), (1, 2, 4, 8)))
        world = tp * pp * dp
        if not 2 <= world <= MAX_SIM_RANKS:
            continue
        if needs_links and (pp < 2 or (pp - 1) * tp * dp < 6):
            continue  # a link is judged against other pipeline links of its kind
        return tp, pp, dp


def make_sim_trial(seed: int, index: int) -> Trial:
    rng = seeds.rng(seed, index)
    band = SIM_BANDS[int(rng.integers(len(SIM_BANDS)))]
    tp, pp, dp = _sim_shape(rng, _is_link_band(band))
    topo = Topology(tp=tp, pp=pp, dp=dp)
    faults, rank, pair = _fault(band, rng, topo)
    faults += _clock_skews(rng, topo.world_size, _skew_count(rng, band))
    scenario = parse_scenario({
        "name": f"trial{index}", "seed": int(rng.integers(2**31)), "iterations": 2,
        "parallel": {"tp": tp, "pp": pp, "dp": dp, "microbatches": max(4, 2 * pp)},
        "model": {"layers": 8, "hidden": 1024, "heads": 16, "seq_len": 1024},
        "cluster": {"jitter": {"compute_sigma": float(rng.uniform(0.01, 0.04)),
                               "link_sigma": float(rng.uniform(0.02, 0.1))}},
        "faults": faults})
    return Trial(index, band, scenario, rank, pair)


# ------------------------------------------------------------------ real
REAL_BANDS = ("throttle 1.2-1.5", "throttle 1.5-3", "slow_link 1.5-3", "slow_link 3-5",
              "link_jitter 0.5-1", "clock_skew only", "healthy")
# (pp, dp) with tp = 1: megatron-core runs TP collectives inside its layers, so
# the program's trace has none to tell TP peers apart (see docs/megascan.md).
REAL_SHAPES = ((2, 2), (4, 1), (3, 1), (2, 1), (1, 4), (1, 2))
REAL_LINK_SHAPES = ((2, 2), (4, 1), (3, 1))  # at least two pipeline links to compare
REAL_MODEL = {"hidden": 64, "heads": 4, "seq_len": 32, "vocab": 64, "micro_batch_size": 2}
REAL_ITERATIONS, REAL_MICROBATCHES, REAL_LAYERS_PER_STAGE = 6, 8, 2


def make_real_trial(seed: int, index: int) -> Trial:
    rng = seeds.rng(seed, index, 1)
    band = REAL_BANDS[int(rng.integers(len(REAL_BANDS)))]
    shapes = REAL_LINK_SHAPES if _is_link_band(band) else REAL_SHAPES
    pp, dp = shapes[int(rng.integers(len(shapes)))]
    topo = Topology(tp=1, pp=pp, dp=dp)
    faults, rank, pair = _fault(band, rng, topo)
    faults += _clock_skews(rng, topo.world_size, _skew_count(rng, band))
    scenario = parse_scenario({
        "name": f"real{index}", "seed": int(rng.integers(2**31)), "iterations": REAL_ITERATIONS,
        "schedule": "1f1b",
        "parallel": {"tp": 1, "pp": pp, "dp": dp, "microbatches": REAL_MICROBATCHES},
        "model": {"layers": REAL_LAYERS_PER_STAGE * pp, **REAL_MODEL},
        "costs": {"p2p_s": REAL_P2P_S},
        "faults": faults})
    return Trial(index, band, scenario, rank, pair)


SIM = TrialPlan("sim", SIM_BANDS, make_sim_trial)
REAL = TrialPlan("real", REAL_BANDS, make_real_trial)
PLANS = {plan.name: plan for plan in (SIM, REAL)}
