"""The detector names the source, not its victims; baselines share the harness."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from megatronapp.scenario.config import parse_scenario
from megatronapp.scan.evidence.detect import Evidence, NoiseModel, judge, megascan, without_cost
from megatronapp.scan.ingest.sketch import Reservoirs
from megatronapp.scan.evidence.params import Params
from megatronapp.scan.diagnosis import Diagnosis
from megatronapp.scan.eval.trials import CONTROLS, make_sim_trial
from megatronapp.scan.eval.validate import METHODS, run_trial, scan_of_result
from megatronapp.parallel.topology import Topology
from sim import run_sim


def _diagnose(tp: int, pp: int, dp: int, faults: list[dict], seed: int = 5) -> Diagnosis:
    s = parse_scenario({
        "seed": seed, "iterations": 2,
        "parallel": {"tp": tp, "pp": pp, "dp": dp, "microbatches": max(4, 2 * pp)},
        "model": {"layers": 8, "hidden": 512, "heads": 8, "seq_len": 512},
        "cluster": {"jitter": {"compute_sigma": 0.03, "link_sigma": 0.05}},
        "faults": faults + [{"kind": "clock_skew", "rank": tp * pp * dp - 1, "offset_us": 4000,
                             "drift_ppm": -70}]})
    return megascan(scan_of_result(run_sim(s)))


def _throttle(rank: int, factor: float = 1.3) -> list[dict]:
    return [{"kind": "throttle", "rank": rank, "factor": factor}]


@pytest.mark.parametrize("tp, pp, dp, rank, where", [
    (4, 1, 1, 2, "tp"),  # its TP peers wait in every tp_allreduce
    (1, 1, 4, 1, "dp"),  # its DP peers wait in dp_allreduce
    (1, 4, 2, 0, "pp"),  # stage 0: everything downstream starts late
    (2, 2, 2, 5, "tp+dp+pp"),
])
def test_throttled_rank_is_the_only_root_cause_and_its_peers_are_victims(tp, pp, dp, rank, where):
    d = _diagnose(tp, pp, dp, _throttle(rank))
    assert [(c.rank, c.kind) for c in d.root_causes] == [(rank, "compute")]
    topo = Topology(tp=tp, pp=pp, dp=dp)
    waited = {"tp": topo.tp_group(rank), "dp": topo.dp_group(rank), "pp": topo.pp_group(rank)}
    for kind in where.split("+"):
        peers = set(waited[kind]) - {rank}
        assert peers <= set(d.victims), kind
    assert rank not in d.victims


def test_downstream_victims_of_a_throttled_middle_stage_are_not_blamed():
    d = _diagnose(1, 4, 2, _throttle(3, 1.5))  # pp stage 1, dp 1
    assert [c.rank for c in d.root_causes] == [3]


def test_slow_link_is_located_to_its_rank_pair():
    d = _diagnose(2, 4, 2, [{"kind": "slow_link", "ranks": [5, 9], "factor": 2.5}])
    top = d.root_causes[0]
    assert top.kind == "link" and {top.rank, top.peer} == {5, 9}
    assert all(c.kind == "link" for c in d.root_causes)


def test_healthy_jittered_run_with_skewed_clocks_is_healthy():
    for seed in range(3):
        assert _diagnose(2, 2, 2, [], seed=seed).healthy


def test_every_method_shares_the_detector_signature():
    scan = scan_of_result(run_sim(make_sim_trial(0, 8).scenario))
    for name, method in METHODS.items():
        d = method(scan)
        assert isinstance(d, Diagnosis), name
        assert {"healthy", "root_causes", "victims"} <= d.to_json().keys()


def _score(outcomes) -> float:
    """Right answers: top-1 on faults, silence on controls."""
    return sum(o.reported == 0 if o.band in CONTROLS else o.top1 for o in outcomes)


def test_megascan_beats_the_naive_baseline_on_fixed_seeds():
    by_method: dict[str, list] = {}
    for index in range(14):
        report = run_trial(seed=2024, index=index, run=run_sim)
        assert report.alignment is not None and report.alignment["offset_err_max_us"] < 10.0
        for o in report.outcomes:
            by_method.setdefault(o.method, []).append(o)
    ours = _score(by_method["megascan"])
    assert ours > _score(by_method["slowest-mean"])
    assert ours >= max(_score(v) for v in by_method.values())


def _evidence(blame_ms: list[float]) -> Evidence:
    """A rank's compute 20% over its expected 50 ms, 2 noise units, in
    100 ms iterations, blamed ``blame_ms`` in each."""
    n = len(blame_ms)
    blame = np.asarray(blame_ms) * 1e-3
    duration = np.full(n, 0.1)
    return Evidence("compute", 3, "peers", np.arange(n), np.full(n, 0.06), np.full(n, 0.05),
                    blame, np.full(n, 0.005), duration, np.cumsum(blame), np.cumsum(duration))


def test_an_iteration_that_makes_up_part_of_an_earlier_delay_leaves_the_rest_standing():
    """Slow in every iteration, the rank delays the job 10 ms in the first,
    the second makes up 2 ms of it (the job had slack there), the third adds
    10 ms: it is named in all three, a persistent cause."""
    (cause,) = judge([_evidence([10.0, -2.0, 10.0])], Params())
    assert cause.rank == 3 and cause.evidence["iterations_hit"] == "all"


def test_a_delay_made_up_in_full_counts_no_more():
    e = _evidence([10.0, -10.0, 0.0])
    assert e.hits(Params()).tolist() == [True, False, False]
    assert judge([e], Params()) == []


def test_a_rank_slow_throughout_that_delays_nothing_is_listed_apart_not_named():
    """Slow in every iteration, but the job never waited for it: no root
    cause, and listed as slow at no cost; once it delays the job it is a
    cause and leaves that list."""
    idle = _evidence([0.0, 0.0, 0.0])
    assert judge([idle], Params()) == []
    (listed,) = without_cost([idle], [], Params())
    assert (listed.rank, listed.kind, listed.evidence["iterations_hit"]) == (3, "compute", "all")
    costly = _evidence([10.0, 10.0, 10.0])
    causes = judge([costly], Params())
    assert [c.rank for c in causes] == [3] and without_cost([costly], causes, Params()) == []


def test_a_link_slow_at_no_cost_is_listed_only_when_slow_each_way_it_carries_traffic():
    """A link 20% over its expected transfer time at no cost: listed when
    each of its directions ran 20% over its own expectation; not when one
    direction ran at its class's speed (the other's receiver waiting on a
    slow stage), nor when one direction was slow by under ``min_slowdown`` in
    one iteration."""
    base = _evidence([0.0, 0.0, 0.0])

    def link(each_way: list[float]) -> Evidence:
        return replace(base, kind="link", who=(2, 6), each_way=np.asarray(each_way))

    (listed,) = without_cost([link([0.2, 0.2, 0.2])], [], Params())
    assert (listed.kind, listed.rank, listed.peer) == ("link", 2, 6)
    assert without_cost([link([0.0, 0.0, 0.0])], [], Params()) == []
    below = Params().min_slowdown / 2
    assert without_cost([link([0.2, below, 0.2])], [], Params()) == []


def test_slow_at_no_cost_needs_every_iteration_and_leaves_host_time_out():
    once = _evidence([0.0, 0.0, 0.0])
    once = Evidence(once.kind, once.who, once.basis, once.iterations,
                    np.array([0.06, 0.05, 0.06]), once.expected, once.blame, once.noise,
                    once.duration, once.delay, once.elapsed)
    assert without_cost([once], [], Params()) == []
    idle = _evidence([0.0, 0.0, 0.0])
    host = Evidence("host", *[getattr(idle, f) for f in ("who", "basis", "iterations", "actual",
                                                          "expected", "blame", "noise",
                                                          "duration", "delay", "elapsed")])
    assert without_cost([host], [], Params()) == []


def test_a_simulated_slow_link_the_pipeline_does_not_wait_for_is_listed_not_named():
    """pp 4 with a slow link 1 -> 5 whose transfers overlap other work: it
    costs its iterations under ``min_share``, so no root cause names it, and
    it heads the list of what is slow at no cost."""
    s = parse_scenario({
        "seed": 11, "iterations": 2,
        "parallel": {"tp": 4, "pp": 4, "dp": 1, "microbatches": 8},
        "model": {"layers": 8, "hidden": 512, "heads": 8, "seq_len": 512},
        "cluster": {"jitter": {"compute_sigma": 0.03, "link_sigma": 0.05}},
        "faults": [{"kind": "slow_link", "ranks": [1, 5], "factor": 2.4}]})
    d = megascan(scan_of_result(run_sim(s)))
    assert not any(c.kind == "link" and {c.rank, c.peer} == {1, 5} for c in d.root_causes)
    top = d.slow_without_cost[0]
    assert top.kind == "link" and {top.rank, top.peer} == {1, 5}
    assert top.evidence["share"] < Params().min_share * 2
    assert d.to_json()["slow_without_cost"][0]["peer"] in (1, 5)


def _noise_of(excess: dict[int, np.ndarray], partners: dict[int, int]) -> dict[int, float]:
    samples: Reservoirs[tuple[str, int]] = Reservoirs(64)
    samples.add_all({("compute", r): v for r, v in excess.items()})
    model = NoiseModel(samples, {("compute", r): ("compute", p) for r, p in partners.items()}, 4)
    return {r: model.sigma(("compute", r)) for r in excess}


def test_a_pair_seen_in_two_iterations_is_judged_against_how_much_each_moves():
    """dp 2, two iterations: the throttled rank's one peer is all there is,
    and two iterations show how much each moves; its gap is not its bar."""
    d = _diagnose(1, 1, 2, _throttle(1, 1.35))
    assert [(c.rank, c.kind) for c in d.root_causes] == [(1, "compute")]
    assert d.root_causes[0].evidence["noise_units"] > 10
    assert _diagnose(1, 1, 2, []).healthy


def test_a_pair_of_peers_is_judged_against_how_much_each_moves_not_against_its_own_gap():
    # two data-parallel ranks, each expected to take the other's time: rank 1 is 40%
    # slower throughout, so their excesses mirror each other about a gap of 0.4
    rng = np.random.default_rng(3)
    moves = 0.02
    slow = 0.4 + rng.normal(0, moves, 12)
    noise = _noise_of({0: -slow, 1: slow}, {0: 1, 1: 0})
    assert noise[1] < 3 * moves  # the bar is the pair's moves ...
    assert 0.4 / noise[1] > 5  # ... so the slow rank stands far out of it


def test_with_a_healthy_pair_left_the_gap_between_peers_is_still_part_of_the_bar():
    # four ranks in two pairs: the healthy pair (2, 3) sits 0.2 apart for good; judging
    # rank 1, its own pair is left out and the healthy pair's gap stays in the bar
    rng = np.random.default_rng(4)
    wobble = {r: rng.normal(0, 0.02, 12) for r in range(4)}
    excess = {0: -0.4 + wobble[0], 1: 0.4 + wobble[1], 2: -0.1 + wobble[2], 3: 0.1 + wobble[3]}
    noise = _noise_of(excess, {0: 1, 1: 0, 2: 3, 3: 2})
    assert noise[1] > 3 * 0.02  # the healthy pair's gap, not the wobble alone
