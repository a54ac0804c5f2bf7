"""Dependency reconstruction and clock alignment against the simulator's truth."""
from __future__ import annotations

import numpy as np
import pytest

from megatronapp.scenario.config import parse_scenario
from megatronapp.scan.align.align import robust_line, trace_span
from megatronapp.scan.eval.clock_truth import score_against_truth
from megatronapp.scan.ingest.deps import annotate, reconstruct
from megatronapp.scan.eval.validate import scan_of_result
from sim import run_sim

SKEWS = [(1, 9_800.0, 95.0), (2, -10_000.0, -100.0), (5, 3_300.0, 0.0), (6, -250.0, 60.0),
         (7, 10_000.0, -40.0)]


def _scenario(schedule: str = "1f1b", vpp: int = 1, skews=SKEWS):
    return parse_scenario({
        "seed": 3, "iterations": 2, "schedule": schedule,
        "parallel": {"tp": 2, "pp": 2, "dp": 2, "vpp": vpp, "microbatches": 4},
        "model": {"layers": 8, "hidden": 512, "heads": 8, "seq_len": 512},
        "cluster": {"jitter": {"compute_sigma": 0.03, "link_sigma": 0.05}},
        "faults": [{"kind": "clock_skew", "rank": r, "offset_us": o, "drift_ppm": d}
                   for r, o, d in skews]})


@pytest.fixture(scope="module")
def skewed():
    return run_sim(_scenario())


def test_offsets_within_10us_and_drift_recovered(skewed):
    scan = scan_of_result(skewed)
    truth = {str(r): {"offset_us": c.offset_us, "drift_ppm": c.drift_ppm}
             for r, c in skewed.clocks.items()}
    err = score_against_truth(scan.clocks, truth, ref=0, span=trace_span(scan.events))
    assert err["ranks"] == 7  # every rank but the reference
    assert err["offset_err_max_us"] < 10.0
    assert err["drift_err_max_ppm"] < 5.0


def test_aligned_events_land_on_true_time(skewed):
    scan = scan_of_result(skewed)
    for rank, events in skewed.events.items():
        got = np.array([e.start_s for e in scan.events[rank]])
        want = np.array([e.start_s for e in sorted(events, key=lambda e: (e.start_s, -e.dur_s))])
        assert np.abs(got - want).max() < 10e-6


@pytest.mark.parametrize("schedule, vpp", [("1f1b", 1), ("interleaved", 2)])
def test_every_sync_op_is_one_communication(schedule, vpp):
    result = run_sim(_scenario(schedule, vpp, skews=[]))
    ops = reconstruct(result.events)
    coll = [op for op in ops if op.kind == "collective"]
    p2p = [op for op in ops if op.kind == "p2p"]
    for op in coll:
        events = [result.events[r][i] for r, i in op.members]
        assert sorted(op.ranks) == sorted(events[0].args["group"])
        assert len({e.name for e in events}) == 1
        assert np.ptp([e.end_s for e in events]) < 1e-12  # collectives end together
    for op in p2p:
        (s, si), (r, ri) = op.members
        send, recv = result.events[s][si], result.events[r][ri]
        assert send.name.replace("send", "recv") == recv.name
        assert (send.args["peer"], recv.args["peer"]) == (r, s)
        assert (send.args["iteration"], send.args["microbatch"]) == (recv.args["iteration"],
                                                                      recv.args["microbatch"])
        assert recv.end_s >= send.end_s - 1e-12  # nothing is received before it is delivered
    comm = sum(1 for ev in result.events.values() for e in ev if "peer" in e.args or "group" in e.args)
    assert sum(len(op.members) for op in ops) == comm  # every comm event is linked once
    linked = annotate(result.events, ops)
    assert all("related_sync_op" in e.args for ev in linked.values() for e in ev
               if "peer" in e.args or "group" in e.args)


def test_robust_line_ignores_outliers():
    rng = np.random.default_rng(0)
    x = np.sort(rng.uniform(0, 2.0, 200))
    y = 0.99995 * x + 0.0042 + rng.normal(0, 1e-8, 200)
    y[::17] += rng.uniform(1e-4, 1e-3, len(y[::17]))  # late anchors, e.g. a missed completion
    a, b = robust_line(x, y)
    assert a == pytest.approx(0.99995, abs=1e-7)
    assert b == pytest.approx(0.0042, abs=1e-7)
