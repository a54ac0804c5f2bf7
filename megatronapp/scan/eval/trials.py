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

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import numpy as np

from megatronapp.faults import KINDS, LinkFault, Truth, ground_truth
from megatronapp.scenario import seeds
from megatronapp.scenario.config import Scenario, fault_job, parse_scenario
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
    # what a detector should name (each fault kind's ground truth; none for controls)
    truth: tuple[Truth, ...] = field(default=())

    @property
    def truth_rank(self) -> int | None:
        """The rank a detector should name, where a rank's fault was injected."""
        return next((t.rank for t in self.truth if t.peer is None), None)

    @property
    def truth_pair(self) -> tuple[int, int] | None:
        """The link a detector should name, where a link's fault was injected."""
        return next(((int(t.rank or 0), t.peer) for t in self.truth if t.peer is not None), None)


@dataclass(frozen=True)
class TrialPlan:
    """A family of trials: its bands (drawn with equal probability) and maker."""

    name: str
    bands: tuple[str, ...]
    make: Callable[[int, int], Trial]  # (seed, index) -> trial


def matches(cause: RootCause, trial: Trial) -> bool:
    return any(t.matches(cause.kind, cause.rank, cause.peer) for t in trial.truth)


def _band_kind(band: str) -> tuple[str, str, float, float]:
    """``kind[:variant] low-high`` -> kind, variant, low, high."""
    head, span = band.split()[:2]
    kind, _, variant = head.partition(":")
    low, high = (float(x) for x in span.split("-"))
    return kind, variant, low, high


def _fault(band: str, rng: np.random.Generator, topo: Topology) -> list[dict[str, Any]]:
    """The band's fault (none for a control), drawn by its kind."""
    if band in CONTROLS:
        return []
    kind, variant, low, high = _band_kind(band)
    return [KINDS[kind].trial(rng, topo, low, high, variant)]


def _named_truth(scenario: Scenario) -> tuple[Truth, ...]:
    return tuple(t for t in ground_truth(scenario.faults, fault_job(scenario))
                 if t.should_name is not None)


def _clock_skews(rng: np.random.Generator, world: int, count: int) -> list[dict]:
    """Offsets up to ±10 ms and drifts up to ±100 ppm on ``count`` ranks (never rank 0,
    the reference: its skew would only shift the whole timeline)."""
    ranks = rng.choice(np.arange(1, world), size=min(count, world - 1), replace=False)
    return [{"kind": "clock_skew", "rank": int(r), "offset_us": float(rng.uniform(-1e4, 1e4)),
             "drift_ppm": float(rng.uniform(-100, 100))} for r in ranks]


def _skew_count(rng: np.random.Generator, band: str) -> int:
    return int(rng.integers(1, 4)) if band == "clock_skew only" else int(rng.integers(0, 3))


def _is_link_band(band: str) -> bool:
    """A link fault's trial needs other pipeline links of its kind to compare."""
    return band not in CONTROLS and issubclass(KINDS[_band_kind(band)[0]], LinkFault)


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


def make_sim_trial(seed: int, index: int, bands: tuple[str, ...] = SIM_BANDS,
                   iterations: int = 2, stream: tuple[int, ...] = ()) -> Trial:
    rng = seeds.rng(seed, index, *stream)
    band = bands[int(rng.integers(len(bands)))]
    tp, pp, dp = _sim_shape(rng, _is_link_band(band))
    topo = Topology(tp=tp, pp=pp, dp=dp)
    faults = _fault(band, rng, topo)
    faults += _clock_skews(rng, topo.world_size, _skew_count(rng, band))
    scenario = parse_scenario({
        "name": f"trial{index}", "seed": int(rng.integers(2**31)), "iterations": iterations,
        "parallel": {"tp": tp, "pp": pp, "dp": dp, "microbatches": max(4, 2 * pp)},
        "model": {"layers": 8, "hidden": 1024, "heads": 16, "seq_len": 1024},
        "cluster": {"jitter": {"compute_sigma": float(rng.uniform(0.01, 0.04)),
                               "link_sigma": float(rng.uniform(0.02, 0.1))}},
        "faults": faults})
    return Trial(index, band, scenario, _named_truth(scenario))


# ------------------------------------------------------------------ real
REAL_BANDS = ("throttle 1.2-1.5", "throttle 1.5-3", "slow_link 1.5-3", "slow_link 3-5",
              "link_jitter 0.5-1", "clock_skew only", "healthy")
# (pp, dp) with tp = 1: megatron-core runs TP collectives inside its layers, so
# the program's trace has none to tell TP peers apart (see docs/megascan.md).
REAL_SHAPES = ((2, 2), (4, 1), (3, 1), (2, 1), (1, 4), (1, 2))
REAL_LINK_SHAPES = ((2, 2), (4, 1), (3, 1))  # at least two pipeline links to compare
REAL_MODEL = {"hidden": 64, "heads": 4, "seq_len": 32, "vocab": 64, "micro_batch_size": 2}
REAL_ITERATIONS, REAL_MICROBATCHES, REAL_LAYERS_PER_STAGE = 6, 8, 2


def make_real_trial(seed: int, index: int, bands: tuple[str, ...] = REAL_BANDS,
                    stream: tuple[int, ...] = (1,)) -> Trial:
    rng = seeds.rng(seed, index, *stream)
    band = bands[int(rng.integers(len(bands)))]
    shapes = REAL_LINK_SHAPES if _is_link_band(band) else REAL_SHAPES
    pp, dp = shapes[int(rng.integers(len(shapes)))]
    topo = Topology(tp=1, pp=pp, dp=dp)
    faults = _fault(band, rng, topo)
    faults += _clock_skews(rng, topo.world_size, _skew_count(rng, band))
    scenario = parse_scenario({
        "name": f"real{index}", "seed": int(rng.integers(2**31)), "iterations": REAL_ITERATIONS,
        "schedule": "1f1b",
        "parallel": {"tp": 1, "pp": pp, "dp": dp, "microbatches": REAL_MICROBATCHES},
        "model": {"layers": REAL_LAYERS_PER_STAGE * pp, **REAL_MODEL},
        "costs": {"p2p_s": REAL_P2P_S},
        "faults": faults})
    return Trial(index, band, scenario, _named_truth(scenario))


# ---------------------------------------------- the kinds added since
# A simulated trial job's iteration takes 30-200 ms (1-2 ms a microbatch's
# forward a stage): stalls of 10-50 ms, flaps every 50 ms, crashes in the
# second half of six iterations. A real one's 0.3-1 s on this machine.
SIM_NEW_BANDS = ("host_stall 0.01-0.05", "host_stall:every3 0.01-0.05",
                 "throttle:every3 1.5-3", "link_flap:every0.05 5-20", "device_variation 0.05-0.2",
                 "clock_skew only", "healthy")
REAL_NEW_BANDS = ("host_stall 0.05-0.2", "host_stall:every3 0.1-0.3", "throttle:every3 2-4",
                  "link_flap:every0.5 50-150", "device_variation 0.2-0.4",
                  "clock_skew only", "healthy")
NEW_ITERATIONS = 6


SIM = TrialPlan("sim", SIM_BANDS, make_sim_trial)
REAL = TrialPlan("real", REAL_BANDS, make_real_trial)
SIM_NEW = TrialPlan("sim-new", SIM_NEW_BANDS, partial(
    make_sim_trial, bands=SIM_NEW_BANDS, iterations=NEW_ITERATIONS, stream=(2,)))
REAL_NEW = TrialPlan("real-new", REAL_NEW_BANDS, partial(
    make_real_trial, bands=REAL_NEW_BANDS, stream=(3,)))
PLANS = {plan.name: plan for plan in (SIM, REAL, SIM_NEW, REAL_NEW)}
