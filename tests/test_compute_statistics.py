"""experiments.compute_statistics: what each reading of a rank's compute
counts as excess, how a rank is scored against the others' spread, and the
command's errors."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from experiments import compute_statistics as cs
from megatronapp.scan.eval.validate import scan_of_result
from megatronapp.scenario.config import parse_scenario
from sim import run_sim

RANKS, OPS, ITERATIONS = 4, 3, 5


def _times(seconds_scale: float = 1.0, calls_scale: int = 1, noise: float = 0.0,
           seed: int = 0) -> cs.OpTimes:
    """Four peers running three ops (1, 2 and 4 calls of 1, 5 and 10 ms) over
    five iterations; rank 2 runs its calls ``seconds_scale`` as long and
    ``calls_scale`` times as often; every call drawn ``noise`` apart."""
    rng = np.random.default_rng(seed)
    per_call = np.array([1e-3, 5e-3, 10e-3])[None, :, None] * \
        (1 + noise * rng.standard_normal((RANKS, OPS, ITERATIONS)))
    calls = np.broadcast_to(np.array([1, 2, 4])[None, :, None], (RANKS, OPS, ITERATIONS)).copy()
    per_call[2] *= seconds_scale
    calls[2] *= calls_scale
    everyone = np.arange(RANKS)
    return cs.OpTimes(everyone, per_call * calls, calls.astype(float), per_call,
                      [everyone[everyone != i] for i in everyone])


@pytest.mark.parametrize("name", sorted(cs.STATISTICS))
def test_a_rank_twice_as_slow_at_every_call_reads_one_in_every_statistic(name: str):
    t = _times(seconds_scale=2.0)
    reading = cs.STATISTICS[name](t, 2)
    assert np.allclose(reading, 1.0)
    assert np.allclose(cs.STATISTICS[name](t, 0), 0.0)


def test_extra_calls_of_the_same_size_are_excess_except_to_the_rate():
    t = _times(calls_scale=2)
    assert np.allclose(cs.totals(t, 2), 1.0)
    assert np.allclose(cs.fastest_call(t, 2), 1.0)
    assert np.allclose(cs.per_call(t, 2), 0.0)


def test_a_slow_rank_scores_far_past_its_peers_spread_and_they_do_not():
    t = _times(seconds_scale=1.5, noise=0.02, seed=3)
    by_rank = cs.run_scores(t)["totals"]
    assert max(by_rank, key=by_rank.__getitem__) == 2
    assert by_rank[2] > 5 > max(v for k, v in by_rank.items() if k != 2)


def test_a_simulated_throttled_rank_scores_highest_by_its_op_times():
    s = parse_scenario({"seed": 5, "iterations": 4,
                        "parallel": {"tp": 1, "pp": 1, "dp": 4, "microbatches": 2},
                        "model": {"layers": 2, "hidden": 256, "heads": 4, "seq_len": 128},
                        "cluster": {"jitter": {"compute_sigma": 0.02}},
                        "faults": [{"kind": "throttle", "rank": 1, "factor": 1.5}]})
    t = cs.OpTimes.of(scan_of_result(run_sim(s), scenario=s))
    slowed = int(np.searchsorted(t.ranks, 1))
    for name, by_rank in cs.run_scores(t).items():
        assert max(by_rank, key=by_rank.__getitem__) == slowed, name


def test_the_table_counts_a_run_only_when_its_slowed_rank_leads_past_the_healthy_bar():
    healthy = [("healthy", True, set(), {n: {0: 1.0, 1: 0.5} for n in cs.STATISTICS})] * 3
    named = ("slow-2x", False, {1}, {n: {0: 0.2, 1: 4.0} for n in cs.STATISTICS})
    under = ("slow-1.3x", False, {1}, {n: {0: 0.2, 1: 0.9} for n in cs.STATISTICS})
    lines = cs.table(healthy + [named, under])
    assert lines[0] == "| statistic | bar | slow-1.3x | slow-2x |"
    assert all(line.endswith("| 0/1 | 1/1 |") for line in lines[2:])


def test_bad_input_is_one_line_and_status_2(capsys: pytest.CaptureFixture[str]):
    assert cs.main(["/nonexistent/set"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("compute_statistics: ") and "\n" not in err
    assert not Path("results/compute_statistics.json").exists()
