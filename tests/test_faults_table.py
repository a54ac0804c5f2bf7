"""The per-kind faults table keeps its runs and scores them again unchanged."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from experiments import faults_table
from megatronapp.errors import UserError


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """Two seeds of three kinds on the simulator, their runs kept."""
    keep = tmp_path_factory.mktemp("kept")
    data = faults_table.empty()
    faults_table.run_part(data, "sim", ["crash", "device_variation", "link_flap"], range(2),
                          ["--keep", str(keep)], keep)
    return data, keep


def test_rescoring_kept_runs_gives_the_rows_of_the_run_that_kept_them(kept):
    data, keep = kept
    again = faults_table.empty()
    keys = faults_table.rescore(again, keep, ["--rescore", str(keep)])
    assert sorted(keys) == sorted(data["seeds"])
    assert again["rows"] == data["rows"]
    assert again["seeds"] == data["seeds"]


def test_a_crash_row_counts_the_stop_its_runs_recorded(kept):
    data, keep = kept
    crash = next(r for r in data["rows"] if r["kind"] == "crash")
    summaries = [json.loads(p.read_text()) for p in sorted(keep.glob("sim/crash/*/summary.json"))]
    assert len(summaries) == 2
    assert crash["stops_recorded"] == sum(s.get("stopped") is not None for s in summaries) == 2
    assert all(r["stops_recorded"] is None for r in data["rows"] if r["kind"] != "crash")


def test_rescoring_replaces_only_the_kept_kinds(kept, tmp_path: Path):
    data, keep = kept
    before = copy.deepcopy(data)
    before["rows"][0]["named_first"] = 99  # a stale verdict the rescore must replace
    other = {**before["rows"][0], "kind": "host_stall", "backend": "torch"}
    before["rows"].append(other)
    faults_table.rescore(before, keep, ["--rescore", str(keep)])
    assert before["rows"][:-1] == data["rows"] and before["rows"][-1] == other


def test_a_folder_without_kept_runs_is_one_line_and_status_2(tmp_path: Path, capsys):
    written = faults_table.results.RESULTS / f"{faults_table.NAME}.json"
    before = written.read_bytes()
    with pytest.raises(SystemExit) as stop:
        faults_table.main(["--rescore", str(tmp_path)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("--rescore:") and err.count("\n") == 1
    assert written.read_bytes() == before  # nothing half-written


def test_an_unknown_kind_is_one_line_and_status_2(capsys):
    with pytest.raises(SystemExit) as stop:
        faults_table.main(["--kinds", "crash,meteor", "--backends", "sim"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith("--kinds: unknown meteor")


def test_a_kept_run_of_a_kind_the_table_lacks_is_one_line(kept, tmp_path: Path):
    _, keep = kept
    run_dir = next(keep.glob(f"sim/crash/seed*/{faults_table.KEPT_FILE}")).parent
    record = json.loads((run_dir / faults_table.KEPT_FILE).read_text())
    stray = tmp_path / "sim" / "meteor" / "seed0000"
    stray.mkdir(parents=True)
    for name in ("summary.json", faults_table.KEPT_FILE):
        (stray / name).write_text((run_dir / name).read_text())
    (stray / faults_table.KEPT_FILE).write_text(json.dumps({**record, "kind": "meteor"}))
    with pytest.raises(UserError, match="^--rescore: .*'meteor'"):
        faults_table.rescore(faults_table.empty(), tmp_path, [])


def test_a_cause_names_the_iterations_a_periodic_fault_hit_only_when_it_lists_them():
    from megatronapp.faults import Truth
    from megatronapp.scan.diagnosis import Diagnosis, RootCause
    from megatronapp.scan.eval.verdicts import verdict

    truth = [Truth("throttle", "compute", 3, iterations=(2, 5))]

    def cause(hit: object) -> Diagnosis:
        return Diagnosis((RootCause(3, "compute", None, 0.9, {"iterations_hit": hit}),))
    assert verdict(cause([2, 5]), truth).iterations is True
    assert verdict(cause([2]), truth).iterations is False
    assert verdict(cause("all"), truth).iterations is False  # not told apart from the others
    every = [Truth("throttle", "compute", 3)]
    assert verdict(cause("all"), every).iterations is None  # nothing to list


def test_a_crash_before_anything_was_recorded_has_no_realised_time_and_the_mean_skips_it():
    """A rank killed before its first events were handed over has no last op:
    its seed's realised time is unknown, not zero, and the row's mean is over
    the seeds that measured one."""
    from types import SimpleNamespace

    from megatronapp.trace.events import Event

    s = SimpleNamespace(faults=[SimpleNamespace(rank=1, at_s=0.5)])
    early = SimpleNamespace(events={0: [Event("forward", 0.0, 0.1, {})], 1: []})
    late = SimpleNamespace(events={1: [Event("forward", 0.2, 0.25, {})]})
    assert math.isnan(faults_table.measure_crash(s, early, None)[1])
    assert faults_table.measure_crash(s, late, None) == (0.5, 0.45)
    verdict = {"named_first": False, "named": False, "iterations": None, "first": "healthy"}
    rows = [{"seed": 0, "injected": 0.5, "realized": None, "verdict": verdict},
            {"seed": 1, "injected": 0.5, "realized": 0.45, "verdict": verdict}]
    case = next(c for c in faults_table.CASES if c.label == "crash")
    assert faults_table.summary(case, "torch", rows)["realized_mean"] == 0.45


def test_an_intermittent_fault_named_where_it_struck_stood_recur_multiple_out(tmp_path: Path):
    """The table's noise units are MegaScan's own evidence: a throttle named
    first for exactly the iterations it hit was, in each, ``recur_multiple``
    noise units out (how an intermittent cause is named), so the median is
    too; a stop is no suspect and has none."""
    from megatronapp.scan.evidence.params import Params

    data = faults_table.empty()
    faults_table.run_part(data, "sim", ["throttle", "crash"], range(2), [], tmp_path)
    throttled = data["seeds"]["sim/throttle, every 3rd iteration"]
    assert all(r["verdict"]["named_first"] and r["verdict"]["iterations"] for r in throttled)
    assert all(r["units_struck"] >= Params().recur_multiple for r in throttled)
    assert all(r["units_struck"] is None for r in data["seeds"]["sim/crash"])
