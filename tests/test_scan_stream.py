"""MegaScan fed batch by batch (``detect.Detector``): bounded state, the same
verdict as the whole trace, and stored runs read a few iterations at a time."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatronapp.cli import main
from megatronapp.scan.align import inputs
from megatronapp.scan.evidence.detect import Detector, megascan, megascan_stored
from megatronapp.scan.align.inputs import (ScanInput, StoredColumns, load_table_scan, prepare_columns,
                                     read_stored, stored_batches)
from megatronapp.scan.ingest.sketch import Reservoir
from megatronapp.scan.eval.validate import scan_of_result
from megatronapp.scenario.config import Scenario, parse_scenario
from megatronapp.trace import store as store_module
from sim import run_sim

THROTTLED, SLOW_LINK = 5, (2, 6)  # dp peers of one stage; a pipeline link between stages


def _job(iterations: int) -> Scenario:
    return parse_scenario({
        "seed": 4, "iterations": iterations, "schedule": "1f1b",
        "parallel": {"tp": 2, "pp": 2, "dp": 2, "microbatches": 4},
        "model": {"layers": 4, "hidden": 1024, "heads": 16, "seq_len": 1024},
        "cluster": {"gpus_per_node": 2, "jitter": {"compute_sigma": 0.02, "link_sigma": 0.05}},
        "faults": [{"kind": "throttle", "rank": THROTTLED, "factor": 1.4},
                   {"kind": "clock_skew", "rank": 3, "offset_us": 2000, "drift_ppm": 40}]})


def _iterations(scan: ScanInput) -> list[ScanInput]:
    """The aligned trace cut into one batch per iteration."""
    cols = scan.cols
    return [prepare_columns(cols.take(cols.iteration == i), aligned=True,
                            gpus_per_node=scan.gpus_per_node)
            for i in np.unique(cols.iteration).tolist()]


def _fed(scan: ScanInput, capacity: int) -> Detector:
    detector = Detector(scan.gpus_per_node, scan.scenario, capacity=capacity)
    for batch in _iterations(scan):
        detector.feed(batch)
    return detector


def _named(diagnosis: Any) -> list[tuple[int, str, int | None]]:
    return [(c.rank, c.kind, c.peer) for c in diagnosis.root_causes]


def test_the_state_does_not_grow_when_the_run_is_fed_twice_as_many_iterations():
    """With room for fewer values per key than 4 iterations give any of them
    (a key gets one value per iteration at least, or per whole iteration:
    3 of 4 are closed), the detector holds as many entries after 8
    iterations as after 4: each sample thins to the same size."""
    short, long = (scan_of_result(run_sim(_job(n))) for n in (4, 8))
    small, large = _fed(short, capacity=2), _fed(long, capacity=2)
    assert large.state_entries() == small.state_entries()
    assert _fed(short, capacity=1 << 20).state_entries() > small.state_entries()


def test_iteration_by_iteration_the_verdict_is_the_whole_traces():
    scan = scan_of_result(run_sim(_job(3)))
    _same_verdict(_fed(scan, capacity=1 << 20).verdict(), megascan(scan))


def _same_verdict(got: Any, expected: Any) -> None:
    """The same causes, confidences, evidence (peers compared, ops counted, ...) and victims."""
    assert _named(got) == _named(expected) and got.victims == expected.victims
    for a, b in zip(got.root_causes, expected.root_causes):
        assert a.confidence == pytest.approx(b.confidence) and a.evidence == b.evidence


def test_a_verdict_can_be_asked_for_after_every_batch():
    scan = scan_of_result(run_sim(_job(3)))
    detector = Detector(scan.gpus_per_node, scan.scenario)
    verdicts = []
    for batch in _iterations(scan):
        detector.feed(batch)
        verdicts.append(_named(detector.verdict()))
    assert verdicts[-1] == _named(megascan(scan)) and verdicts[-1][0][0] == THROTTLED


def _stored(tmp_path: Path, iterations: int) -> Path:
    """The store of ``_job(iterations)`` run by ``megatronapp run``."""
    scenario = tmp_path / "job.yaml"
    scenario.write_text(_job(iterations).model_dump_json())
    assert main(["run", str(scenario), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    return tmp_path / "run" / "trace.parquet"


def test_a_stored_run_is_read_one_batch_of_iterations_at_a_time(tmp_path: Path, monkeypatch):
    store = _stored(tmp_path, 4)
    whole = load_table_scan(store)
    monkeypatch.setattr(inputs, "BATCH_ROWS", len(whole.cols) // 4)
    fed = [np.unique(b.cols.iteration).tolist() for b in stored_batches(store)]
    assert fed == [[0], [1], [2], [3]]  # one iteration per batch
    _same_verdict(megascan_stored(store), megascan(whole))


def test_no_more_rows_are_decoded_at_once_than_a_batch_holds(tmp_path: Path, monkeypatch):
    """The file is read in pieces: a long iteration cut by microbatch is never
    decoded whole (only the piece-reader's row groups and each batch are)."""
    store = _stored(tmp_path, 1)
    whole = load_table_scan(store)
    monkeypatch.setattr(inputs, "BATCH_ROWS", len(whole.cols) // 2)
    decoded: list[int] = []
    columns_of_table = store_module._columns

    def spy(table: Any, meta: Any) -> Any:
        decoded.append(table.num_rows)
        return columns_of_table(table, meta)

    monkeypatch.setattr(store_module, "_columns", spy)
    monkeypatch.setattr(store_module, "ROW_GROUP", 256)
    largest = max(len(b.cols) for b in stored_batches(store))
    assert largest < len(whole.cols) and decoded and max(decoded) <= largest
    _same_verdict(megascan_stored(store), megascan(whole))


def test_an_iteration_longer_than_a_batch_is_fed_microbatch_by_microbatch(tmp_path: Path,
                                                                          monkeypatch):
    store = _stored(tmp_path, 1)
    whole = load_table_scan(store)
    monkeypatch.setattr(inputs, "BATCH_ROWS", len(whole.cols) // 2)
    batches = list(stored_batches(store))
    microbatches = [np.unique(b.cols.microbatch).tolist() for b in batches]
    assert microbatches == [[-1, 0], [1], [2], [3]]  # the optimizer's and all-reduces: -1
    skewed = whole.clocks[3]  # another replica's rank: no microbatch's ops tie it to rank 0
    for batch in batches:
        assert (batch.clocks[3].a, batch.clocks[3].b) == pytest.approx((skewed.a, skewed.b),
                                                                        abs=1e-9)
    _same_verdict(megascan_stored(store), megascan(whole))


@given(st.lists(st.floats(-1e3, 1e3), max_size=300), st.integers(1, 40),
       st.lists(st.integers(1, 50), min_size=1, max_size=8))
def test_a_reservoir_keeps_an_evenly_spread_sample_within_its_capacity(values, capacity, cuts):
    """Whatever the batches, it holds at most ``capacity`` values: every one
    while they fit, else those at every ``stride``-th place of the stream."""
    reservoir = Reservoir(capacity)
    stream = np.array(values, float)
    at = 0
    for cut in cuts * (len(stream) // max(sum(cuts), 1) + 1):
        reservoir.add(stream[at:at + cut])
        at += cut
    assert len(reservoir) <= capacity
    assert reservoir.values.tolist() == stream[::reservoir.stride].tolist()
    assert reservoir.stride == 1 or len(stream) > capacity


def test_a_thinned_sample_still_reports_every_op_it_compared():
    scan = scan_of_result(run_sim(_job(4)))
    thinned, whole = _fed(scan, capacity=16).verdict(), megascan(scan)
    assert _named(thinned)[0] == _named(whole)[0] == (THROTTLED, "compute", None)
    assert thinned.root_causes[0].evidence["ops_compared"] == \
        whole.root_causes[0].evidence["ops_compared"] > 16
