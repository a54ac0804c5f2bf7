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
from megatronapp.scan.evidence.detect import FIELDS, Detector, megascan, megascan_stored
from megatronapp.scan.evidence.params import Params
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
    detector = Detector(scan.gpus_per_node, scan.scenario, Params(capacity=capacity))
    for batch in _iterations(scan):
        detector.feed(batch)
    return detector


def _named(diagnosis: Any) -> list[tuple[int, str, int | None]]:
    return [(c.rank, c.kind, c.peer) for c in diagnosis.root_causes]


def _bound(detector: Detector, scan: ScanInput, capacity: int) -> int:
    """What the state may hold whatever the run's length: per suspect (each
    rank's compute and host time, each link) its figures (``FIELDS``) of at most twice
    ``capacity`` iterations and ``capacity`` noise samples, the lengths of the
    iterations they name, per rank its critical-path shares, and the job's
    groups and pairs (fixed by its layout)."""
    ranks = len(scan.ranks)
    suspects = 2 * ranks + len(detector._pairs)
    per_suspect = len(FIELDS) * 2 * capacity + capacity
    return (suspects * per_suspect + suspects * 2 * capacity + ranks
            + sum(len(m) for m in detector._met.values()) + len(detector._pairs))


def test_the_state_is_bounded_whatever_the_runs_length():
    """Fed twice as many iterations with room for fewer figures per suspect
    than they give, the detector holds no more than the bound; with room for
    everything, it would hold more."""
    long = scan_of_result(run_sim(_job(12)))
    thinned, whole = _fed(long, capacity=2), _fed(long, capacity=1 << 20)
    assert thinned.state_entries() <= _bound(thinned, long, 2) < whole.state_entries()


def test_iteration_by_iteration_the_verdict_is_the_whole_traces():
    scan = scan_of_result(run_sim(_job(3)))
    _same_verdict(_fed(scan, capacity=1 << 20).verdict(), megascan(scan))


def _same_verdict(got: Any, expected: Any) -> None:
    """The same causes and victims, each blamed about as much: a batch is
    replayed from its own start, so an iteration fed alone does not carry the
    lateness of the one before it."""
    assert _named(got) == _named(expected) and got.victims == expected.victims
    for a, b in zip(got.root_causes, expected.root_causes):
        assert a.evidence["blame_s"] == pytest.approx(b.evidence["blame_s"], rel=0.2)


def test_a_verdict_can_be_asked_for_after_every_batch():
    scan = scan_of_result(run_sim(_job(3)))
    detector = Detector(scan.gpus_per_node, scan.scenario)
    verdicts = []
    for batch in _iterations(scan):
        detector.feed(batch)
        verdicts.append(_named(detector.verdict()))
    assert verdicts[-1] == _named(megascan(scan)) and verdicts[-1][0][0] == THROTTLED


def _stored(tmp_path: Path, iterations: int, dp: int = 2) -> Path:
    """The store of ``_job(iterations)`` (with ``dp`` replicas) run by ``megatronapp run``."""
    scenario = tmp_path / "job.yaml"
    job = _job(iterations)
    job = job.model_copy(update={"parallel": job.parallel.model_copy(update={"dp": dp})})
    scenario.write_text(job.model_dump_json())
    assert main(["run", str(scenario), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    return tmp_path / "run" / "trace.parquet"


def test_a_stored_run_is_read_one_batch_of_iterations_at_a_time(tmp_path: Path, monkeypatch):
    store = _stored(tmp_path, 4)
    whole = load_table_scan(store)
    monkeypatch.setattr(inputs, "BATCH_ROWS", len(whole.cols) // 4)
    fed = [np.unique(b.cols.iteration).tolist() for b in stored_batches(store)]
    assert fed == [[0], [1], [2], [3]]  # one iteration per batch
    _same_verdict(megascan_stored(store), megascan(whole))


def _replicas(ranks: np.ndarray, tp: int = 2, dp: int = 4) -> list[int]:
    return sorted(set(((ranks // tp) % dp).tolist()))


def test_an_iteration_longer_than_a_batch_is_fed_two_replicas_at_a_time(tmp_path: Path,
                                                                      monkeypatch):
    """Each batch holds whole pipelines of the iteration (a rank's program
    order whole, so its host time is what it is), two replicas at a time (a
    stage has a peer in each), decoded piece by piece for those ranks only."""
    store = _stored(tmp_path, 1, dp=4)
    whole = load_table_scan(store)
    monkeypatch.setattr(inputs, "BATCH_ROWS", len(whole.cols) // 2)
    decoded: list[int] = []
    columns_of_table = store_module._columns

    def spy(table: Any, meta: Any) -> Any:
        decoded.append(table.num_rows)
        return columns_of_table(table, meta)

    monkeypatch.setattr(store_module, "_columns", spy)
    batches = list(stored_batches(store))
    assert [_replicas(np.unique(b.cols.rank)) for b in batches] == [[0, 1], [2, 3]]
    assert max(decoded) == max(len(b.cols) for b in batches) < len(whole.cols)
    for batch in batches:  # every rank's whole iteration
        for r in np.unique(batch.cols.rank).tolist():
            assert (batch.cols.rank == r).sum() == (whole.cols.rank == r).sum()
    assert _named(megascan_stored(store))[0] == _named(megascan(whole))[0] == (
        THROTTLED, "compute", None)


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


def test_a_thinned_state_still_names_the_throttled_rank_over_every_iteration():
    scan = scan_of_result(run_sim(_job(12)))
    thinned, whole = _fed(scan, capacity=2).verdict(), megascan(scan)
    assert _named(thinned)[0] == _named(whole)[0] == (THROTTLED, "compute", None)
    assert thinned.root_causes[0].evidence["iterations_seen"] <= 4  # thinned from 12
