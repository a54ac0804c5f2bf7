"""MegaScan on real-like timing, without spawning anything.

A simulated run is made to look like a real one the way a shared CPU machine
distorts it (what the torch backend's traces show): a receive ends when its
thread wakes up (later than delivery, by a heavy-tailed delay); a send is
only seen to end when the program waits for it at the end of the iteration;
the members of a collective leave it at different times; compute ops are
stretched at random by contention; a faulty link delays its receiver after
the receive completed, as the torch backend injects it.
"""
from __future__ import annotations


import numpy as np
import pytest

from megatronapp.scan.align.align import trace_span
from megatronapp.scan.eval.clock_truth import score_against_truth
from megatronapp.scan.align.bounds import Bounds, maximin_line
from megatronapp.scan.evidence.detect import megascan
from megatronapp.scan.align.pairwise import shorth
from megatronapp.scan.eval.validate import injected_clocks, scan_of_result
from megatronapp.trace.events import RunResult

from .support import real_like, real_like_run

@pytest.fixture(scope="module")
def pipeline() -> RunResult:
    """Four stages, six iterations as the real trials (no stage peers: stages
    are compared with each other, so only links are judged here)."""
    return real_like_run(1, 4, 1, iterations=6)


@pytest.fixture(scope="module")
def data_parallel() -> RunResult:
    """Two pipelines of two stages, six iterations (as the real trials)."""
    return real_like_run(1, 2, 2, iterations=6)


# ------------------------------------------------------------- alignment
def test_bounds_centre_between_one_sided_noise_and_see_the_drift():
    rng = np.random.default_rng(1)
    x = np.sort(rng.uniform(0, 2.0, 400))
    true_a, true_b = 1 + 80e-6, 3e-3
    slack = 80e-6 + rng.exponential(2e-3, 400)  # a late wake-up only ever loosens a bound
    lower, upper = x[::2], x[1::2]
    bounds = Bounds(lower, true_a * lower + true_b - slack[::2], upper,
                    true_a * upper + true_b + slack[1::2], np.ones(200, bool), np.ones(200, bool))
    a, b, margin = maximin_line(bounds)
    assert abs((a * 1.0 + b) - (true_a * 1.0 + true_b)) < 30e-6  # mid-trace error
    assert abs(a - true_a) < 30e-6 and margin > 0


def test_shorth_keeps_the_agreeing_half():
    late = np.array([0.0, 0.01, -0.02, 3.9, -4.1, 3.2]) * 1e-3
    mid, width = shorth(late)
    assert abs(mid) < 20e-6 and width < 40e-6


def _errors_us(real: RunResult) -> dict[int, float]:
    """Each rank's aligned-clock error at the middle of the trace."""
    scan = scan_of_result(real)
    assert all(f.method == "bounds" for r, f in scan.clocks.items() if r != 0)
    middle = sum(trace_span(scan.events)) / 2
    return {r: (scan.clocks[r].to_ref(c.local(middle)) - middle) * 1e6
            for r, c in real.clocks.items()}


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_real_like_pipeline_clocks_are_tied_by_transfers(pipeline, seed):
    """Completions are off by up to milliseconds here; transfers in both
    directions still place every stage within a few hundred microseconds,
    most within tens (a stage whose receives are mostly posted late has
    tight bounds on one side only)."""
    errors = sorted(abs(e) for r, e in _errors_us(real_like(pipeline, seed=seed)).items() if r)
    assert errors[len(errors) // 2] < 100 and errors[-1] < 300


@pytest.mark.parametrize("seed", [2, 3])
def test_real_like_data_parallel_clocks(data_parallel, seed):
    """Each pipeline is tied by its transfers; the two replicas meet only in
    all-reduces whose members leave ~0.5 ms apart, which place them within
    a millisecond of each other."""
    errors = _errors_us(real_like(data_parallel, seed=seed))
    assert abs(errors[2] - errors[0]) < 100 and abs(errors[3] - errors[1]) < 100
    assert max(abs(e) for e in errors.values()) < 1000


def test_exact_completions_still_take_the_anchor_fit(pipeline):
    scan = scan_of_result(pipeline)
    assert all(f.method == "anchors" for f in scan.clocks.values())
    err = score_against_truth(scan.clocks, injected_clocks(pipeline), 0, trace_span(scan.events))
    assert err["offset_err_max_us"] < 1.0


# ------------------------------------------------------------- detection
def test_a_throttle_is_named_and_contention_is_not():
    throttled = real_like_run(1, 2, 2, iterations=6, faults=({"kind": "throttle", "rank": 1, "factor": 1.6},))
    real = real_like(throttled, seed=3, contended={2: 0.7, 0: 0.3})
    d = megascan(scan_of_result(real))
    assert [(c.rank, c.kind) for c in d.root_causes] == [(1, "compute")]


def test_contention_alone_is_healthy(data_parallel):
    real = real_like(data_parallel, seed=5, contended={2: 0.8, 1: 0.2})
    assert megascan(scan_of_result(real)).healthy


def test_a_slow_link_is_named_with_its_transfers_cost(pipeline):
    real = real_like(pipeline, seed=6, link=((1, 2), "slow", 4e-3))
    d = megascan(scan_of_result(real))
    (top,) = [c for c in d.root_causes if c.kind == "link"]
    assert {top.rank, top.peer} == {1, 2}
    assert top.evidence["actual_s"] > top.evidence["expected_s"] + top.evidence["blame_s"] / 2


@pytest.mark.parametrize("seed", [8, 9, 10])
def test_real_like_links_are_not_blamed_without_a_fault(pipeline, seed):
    d = megascan(scan_of_result(real_like(pipeline, seed=seed, contended={1: 0.5})))
    assert not [c for c in d.root_causes if c.kind == "link"]


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_real_like_contention_names_nothing_but_the_contended_rank(data_parallel, seed):
    """Rank 1 shares its core half the time: its compute runs 1.7-2.2x its
    peers', a straggler the machine made (a noisy neighbour). MegaScan may
    name it, where it delayed iterations, but never another rank or a link."""
    d = megascan(scan_of_result(real_like(data_parallel, seed=seed, contended={1: 0.5})))
    assert all((c.rank, c.kind) in {(1, "compute"), (1, "host")} for c in d.root_causes)
