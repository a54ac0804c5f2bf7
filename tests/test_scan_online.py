"""On-line MegaScan (megatronapp/scan/online/online.py): verdicts from a window of
iterations fed one at a time, and withdrawals when later windows contradict."""
from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import pytest

from megatronapp.scan.online.live import scan_for
from megatronapp.scan.online.online import (SIMULATED, Detection, OnlineConfig, OnlineScan,
                                     iterations_of)
from megatronapp.scenario.config import Scenario, load_scenario
from megatronapp.trace.columns import EventColumns, source_of
from megatronapp.trace.summary import run_iteration_times
from sim import simulate

ROOT = Path(__file__).resolve().parents[1]
THROTTLED = 5  # scenarios/throttle.yaml's throttled rank


def throttle_job(iterations: int, faults: str) -> Scenario:
    return load_scenario(ROOT / "scenarios/throttle.yaml",
                         [f"iterations={iterations}", f"faults={faults}"])


def fed(s: Scenario, config: OnlineConfig = OnlineConfig()
        ) -> tuple[OnlineScan, list[tuple[int, EventColumns]]]:
    scan = OnlineScan(config, scenario=s)
    iterations = list(iterations_of(source_of(simulate(s))))
    for i, cols in iterations:
        scan.feed(i, cols)
    return scan, iterations


def first_iteration_after(iterations: list[tuple[int, EventColumns]], rank: int,
                          start_s: float) -> int:
    """The first iteration in which ``rank`` computes after ``start_s`` (the onset)."""
    return min(i for i, c in iterations
               if bool(((c.rank == rank) & (c.start_s >= start_s)).any()))


def test_a_throttle_that_starts_mid_run_is_named_soon_after_its_onset_and_not_before() -> None:
    start_s = 0.5  # about iteration 4 of scenarios/throttle.yaml
    s = throttle_job(10, f"[{{kind: throttle, rank: {THROTTLED}, factor: 1.3, start_s: {start_s}}}]")
    scan, iterations = fed(s)
    onset = first_iteration_after(iterations, THROTTLED, start_s)
    assert 0 < onset < 8
    named = [d for d in scan.records if d.event == "named"]
    assert [d.key for d in named] == [("compute", THROTTLED, None)]
    assert onset <= named[0].first_seen <= named[0].iteration <= onset + 3
    assert named[0].evidence["window"][1] == named[0].iteration


@pytest.mark.parametrize("into_iteration", [0.6, 0.8])
def test_without_jitter_a_throttle_late_in_its_onset_iteration_is_named_within_3(
        into_iteration: float) -> None:
    """The simulated default (a window of one) names a throttle that starts
    late in an iteration within three iterations, and never later than a
    window of two, which holds the onset iteration's healthy part (every
    healthy run of the op is exactly as fast as its peers')."""
    def job(iterations: int, faults: str) -> Scenario:
        return load_scenario(ROOT / "scenarios/throttle.yaml", [
            f"iterations={iterations}", f"faults={faults}",
            "cluster.jitter={compute_sigma: 0, link_sigma: 0}"])
    period = statistics.mean(run_iteration_times(simulate(job(2, "[]"))))
    start_s = (2 + into_iteration) * period
    s = job(8, f"[{{kind: throttle, rank: {THROTTLED}, factor: 1.3, start_s: {start_s}}}]")
    latencies = {}
    for window, config in (("two", OnlineConfig(window=2)), ("simulated", SIMULATED)):
        scan, iterations = fed(s, config)
        onset = first_iteration_after(iterations, THROTTLED, start_s)
        named = [d for d in scan.records if d.event == "named"]
        assert [d.key for d in named] == [("compute", THROTTLED, None)]
        latencies[window] = named[0].iteration - onset + 1
    assert latencies["simulated"] <= min(3, latencies["two"])


@pytest.mark.parametrize("config", [OnlineConfig(), SIMULATED])
def test_a_healthy_job_gets_no_verdict(config: OnlineConfig) -> None:
    scan, iterations = fed(throttle_job(12, "[]"), config)
    assert len(iterations) == 12 and scan.records == []


def test_a_verdict_is_withdrawn_once_the_fault_is_gone_and_the_withdrawal_is_recorded() -> None:
    end_s = 0.5  # the throttle ends about iteration 4: later windows contradict the verdict
    s = throttle_job(12, f"[{{kind: throttle, rank: {THROTTLED}, factor: 1.5, end_s: {end_s}}}]")
    config = OnlineConfig(window=2, confirm=2, clear=3)
    scan, iterations = fed(s, config)
    events = [(d.event, d.key) for d in scan.records]
    assert events == [("named", ("compute", THROTTLED, None)),
                      ("withdrawn", ("compute", THROTTLED, None))]
    withdrawn = scan.records[1]
    assert withdrawn.evidence["windows_without"] == config.clear
    assert withdrawn.iteration > first_iteration_after(iterations, THROTTLED, end_s)
    assert scan.named == ()


def live_records(s: Scenario) -> list[tuple[str, tuple, int]]:
    """What ``run --detect`` on real ranks decides, fed ``s``'s iterations in order."""
    scan = scan_for(s, live=True)
    return [(d.event, d.key, d.iteration) for i, c in iterations_of(source_of(simulate(s)))
            for d in scan.feed(i, c)]


def test_on_real_ranks_a_rank_slow_for_two_windows_is_not_named_but_one_that_stays_is() -> None:
    """A rank descheduled for a few iterations on a shared machine looks like
    this 1.5x slowdown of about three iterations: two windows find it, a third
    does not. Real ranks need a third window; the throttle that stays is still
    named within 5 iterations of its onset."""
    period = statistics.mean(run_iteration_times(simulate(throttle_job(4, "[]"))))
    start_s, end_s = 3 * period, 6.5 * period
    passing = throttle_job(12, f"[{{kind: throttle, rank: {THROTTLED}, factor: 1.5, "
                               f"start_s: {start_s}, end_s: {end_s}}}]")
    assert ("named", ("compute", THROTTLED, None)) in [
        (d.event, d.key) for d in fed(passing, OnlineConfig(aligned=False))[0].records]
    assert live_records(passing) == []
    staying = throttle_job(12, f"[{{kind: throttle, rank: {THROTTLED}, factor: 1.5, "
                               f"start_s: {start_s}}}]")
    onset = first_iteration_after(list(iterations_of(source_of(simulate(staying)))),
                                  THROTTLED, start_s)
    records = live_records(staying)
    assert [r[:2] for r in records] == [("named", ("compute", THROTTLED, None))]
    assert onset <= records[0][2] <= onset + 4


def test_a_slow_link_is_named_as_a_link() -> None:
    scan, _ = fed(throttle_job(6, "[{kind: slow_link, ranks: [5, 9], factor: 2}]"))
    assert [d.key for d in scan.named] == [("link", 5, 9)]


def test_a_slow_link_that_starts_mid_run_is_named_soon_after_its_onset_and_not_before() -> None:
    start_s, (src, dst) = 0.5, (5, 9)  # about iteration 4 of scenarios/throttle.yaml
    s = throttle_job(10, f"[{{kind: slow_link, ranks: [{src}, {dst}], factor: 2, "
                         f"start_s: {start_s}}}]")
    scan, iterations = fed(s)
    onset = min(i for i, c in iterations if bool(
        ((c.rank == src) & (c.peer == dst) & (c.start_s >= start_s)).any()))
    assert 0 < onset < 8
    named = [d for d in scan.records if d.event == "named"]
    assert [d.key for d in named] == [("link", src, dst)]
    assert onset <= named[0].first_seen <= named[0].iteration <= onset + 3


def megascale_cut(faults: str, *shape: str) -> list[tuple[str, int, int | None]]:
    """What on-line MegaScan names, as the simulator runs it, on a 128-GPU cut
    of the 12,288-GPU job (tp 8, pp 8, dp 2, interleaved; no jitter)."""
    s = load_scenario(ROOT / "scenarios/megascale_12288.yaml",
                      ["parallel.dp=2", "iterations=2", *shape, f"faults={faults}"])
    scan = OnlineScan(SIMULATED, gpus_per_node=s.cluster.gpus_per_node, scenario=s)
    for i, cols in iterations_of(source_of(simulate(s)), compact=True):
        scan.feed(i, cols)
    return sorted(d.key for d in scan.named)


@pytest.mark.parametrize("shape", [(), ("parallel.microbatches=8", "model.layers=48")])
def test_a_throttle_names_its_rank_not_the_links_its_pipeline_crowds(shape: tuple[str, ...]
                                                                      ) -> None:
    """A 1.5x throttle shifts its replica's schedule: with 32 microbatches
    later stages' transfers cross their ports together (median time per byte
    ~1.28x the class's, their fastest as fast), with 8 its links' deliveries
    wait (median 200x the class's, fastest as fast). Only the rank is named."""
    assert megascale_cut("[{kind: throttle, rank: 90, factor: 1.5}]", *shape) == [
        ("compute", 90, None)]


@pytest.mark.parametrize("link", [(104, 120), (8, 120)])
def test_a_slow_link_in_a_throttled_pipeline_is_still_named(link: tuple[int, int]) -> None:
    """Links the throttle crowds, slow 2x besides: slow at their best too."""
    faults = (f"[{{kind: throttle, rank: 90, factor: 1.5}}, "
              f"{{kind: slow_link, ranks: [{link[0]}, {link[1]}], factor: 2}}]")
    assert megascale_cut(faults) == [("compute", 90, None), ("link", *link)]


def test_a_reduced_run_fed_compact_gets_the_verdicts_of_every_rank_expanded() -> None:
    """Classes of identical pipelines (no jitter): fed only the stored rows, the
    detector decides what it decides fed every rank."""
    s = load_scenario(ROOT / "scenarios/throttle.yaml", [
        "iterations=8", "parallel.dp=4", "cluster.jitter={compute_sigma: 0, link_sigma: 0}",
        f"faults=[{{kind: throttle, rank: {THROTTLED}, factor: 1.3, start_s: 0.3}}, "
        "{kind: slow_link, ranks: [17, 25], factor: 2, start_s: 0.2}]"])
    source = source_of(simulate(s))
    runs = []
    for compact in (False, True):
        scan = OnlineScan(scenario=s)
        parts = list(iterations_of(source, compact=compact))
        for i, cols in parts:
            scan.feed(i, cols)
        ranks = {int(r) for _, c in parts for r in np.unique(c.rank)}
        runs.append(([(d.event, d.key, d.first_seen, d.iteration) for d in scan.records], ranks))
    (full, every), (compact_records, stored) = runs
    assert len(every) == s.world_size > len(stored)
    assert {k for _, k, _, _ in full} == {("compute", THROTTLED, None), ("link", 17, 25)}
    assert compact_records == full


def test_the_state_holds_only_the_last_window_of_iterations() -> None:
    scan, iterations = fed(throttle_job(6, "[]"), OnlineConfig(window=3))
    assert scan.window_iterations == tuple(i for i, _ in iterations[-3:])
    assert scan.iterations == 6


def test_iterations_of_splits_a_run_by_iteration_keeping_every_event() -> None:
    result = simulate(throttle_job(3, "[]"))
    parts = list(iterations_of(source_of(result)))
    assert [i for i, _ in parts] == [0, 1, 2]
    assert sum(len(c) for _, c in parts) == source_of(result).events
    assert all(bool(np.all(c.iteration == i)) for i, c in parts)


def test_a_long_run_read_in_blocks_of_iterations_gives_every_iteration_as_read_whole() -> None:
    source = source_of(simulate(throttle_job(7, "[]")))
    whole = list(iterations_of(source))
    per_iteration = len(whole[0][1])
    for max_rows in (per_iteration, 3 * per_iteration):  # 1 and 3 iterations a pass
        blocks = list(iterations_of(source, max_rows=max_rows))
        assert [i for i, _ in blocks] == [i for i, _ in whole]
        for (_, a), (_, b) in zip(blocks, whole):
            assert sorted(zip(a.rank.tolist(), a.start_s.tolist(), a.dur_s.tolist())) == \
                sorted(zip(b.rank.tolist(), b.start_s.tolist(), b.dur_s.tolist()))


def test_a_detection_says_what_it_names_in_json_and_in_one_line() -> None:
    d = Detection("named", "link", 5, 9, 0.9, 3, 4, {"window": [3, 4]})
    assert d.to_json()["rank"] == 5 and d.to_json()["peer"] == 9
    assert "link 5-9" in d.line() and "iteration 3" in d.line()


@pytest.mark.parametrize("field", ["window", "confirm", "clear"])
def test_a_config_without_evidence_is_refused(field: str) -> None:
    counts: dict[str, int] = {"window": 2, "confirm": 2, "clear": 3, field: 0}
    with pytest.raises(ValueError, match=field):
        OnlineConfig(window=counts["window"], confirm=counts["confirm"], clear=counts["clear"])
