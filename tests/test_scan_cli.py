"""megatronapp detect / analyze / query / align / validate-detector / plot."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from megatronapp.scan.methods import DETECTORS

from megatronapp.cli import main
from megatronapp.scenario.config import parse_scenario
from megatronapp.run.write import write_run
from megatronapp.scan.ingest.load import read_events
from megatronapp.scan.cli import plot_hook
from megatronapp.scan.plots import mean_durations, pipeline_of
from sim import run_sim

SCENARIO = {
    "name": "cli", "seed": 2, "iterations": 2,
    "parallel": {"tp": 2, "pp": 2, "dp": 2, "microbatches": 4},
    "model": {"layers": 8, "hidden": 512, "heads": 8, "seq_len": 512},
    "cluster": {"jitter": {"compute_sigma": 0.02, "link_sigma": 0.05}},
    "faults": [{"kind": "throttle", "rank": 6, "factor": 1.4},
               {"kind": "clock_skew", "rank": 3, "offset_us": -7000, "drift_ppm": 80}]}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    s = parse_scenario(SCENARIO)
    out = tmp_path_factory.mktemp("scan") / "run"
    out.mkdir()
    write_run(s, run_sim(s), out)
    return out


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_detect_json_names_the_throttled_rank(run_dir, capsys):
    code, out, _ = _run(capsys, "detect", str(run_dir), "--json")
    d = json.loads(out)
    assert code == 0 and d["healthy"] is False
    top = d["root_causes"][0]
    assert (top["rank"], top["kind"], top["peer"]) == (6, "compute", None)
    ev = top["evidence"]
    assert 0 < top["confidence"] <= 1 and ev["actual_s"] > 1.2 * ev["expected_s"]
    assert 0 < ev["blame_s"] <= ev["actual_s"] - ev["expected_s"] + 1e-6
    assert ev["share"] == pytest.approx(ev["blame_s"] / ev["iteration_s"], rel=0.01)
    assert 6 not in d["victims"] and 7 in d["victims"]  # its TP peer waited


def test_detect_text_explains_the_evidence(run_dir, capsys):
    code, out, _ = _run(capsys, "detect", str(run_dir))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("root cause: rank 6 (compute")
    assert lines[1].startswith("  blame: ") and "iteration" in lines[1]
    assert "at its peers' speed" in lines[2] and "victims" in out


def test_analyze_matches_a_direct_computation_from_the_trace(run_dir, capsys):
    code, out, _ = _run(capsys, "analyze", str(run_dir / "trace.json"), "--json")
    result = json.loads(out)
    raw = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    busy = sum(e["dur"] for e in raw if e.get("pid") == 6 and e.get("cat") == "compute") * 1e-6
    assert code == 0 and result["ranks"]["6"]["compute_s"] == pytest.approx(busy, rel=1e-6)
    assert len(result["iteration_times_s"]) == 2 and 0 < result["bubble_fraction"] < 1
    path = result["critical_path"]  # the throttled rank carries most of it
    assert next(iter(path["by_rank"])) == "6" and path["length_s"] <= path["window_s"]


def test_query_runs_sql_over_events(run_dir, capsys):
    sql = ("SELECT rank, sum(dur_us) AS busy FROM events WHERE kind = 'compute' "
           "GROUP BY rank ORDER BY busy DESC LIMIT 1")
    code, out, _ = _run(capsys, "query", str(run_dir), sql, "--json")
    assert code == 0 and json.loads(out)[0]["rank"] == 6
    code, out, _ = _run(capsys, "query", str(run_dir),
                        "SELECT count(*) AS n FROM events WHERE related_sync_op IS NULL "
                        "AND kind IN ('p2p', 'collective')")
    assert code == 0 and out.split()[-1] == "0"


def test_align_writes_a_linked_trace_and_scores_it(run_dir, capsys):
    out_file = run_dir / "aligned.json"
    code, out, _ = _run(capsys, "align", str(run_dir), "--out", str(out_file), "--json")
    report = json.loads(out)
    assert code == 0 and report["error_vs_ground_truth"]["offset_err_max_us"] < 10
    events = json.loads(out_file.read_text())["traceEvents"]
    assert any("related_sync_op" in e.get("args", {}) for e in events)


def test_validate_detector_writes_its_table(tmp_path, capsys):
    path = tmp_path / "v.csv"
    code, out, _ = _run(capsys, "validate-detector", "--trials", "3", "--seed", "1", "--csv", str(path))
    rows = list(csv.DictReader(path.open()))
    assert code == 0 and "| megascan |" in out
    assert {r["method"] for r in rows} == set(DETECTORS)


def test_plot_hook_adds_heatmap_and_marey(run_dir):
    import megatronapp.cli as cli

    args = cli.build_parser().parse_args(["plot", str(run_dir)])
    assert plot_hook in args.plot_hooks  # what `megatronapp plot` calls after the timeline
    paths = plot_hook(run_dir, read_events(run_dir / "trace.json"))
    assert [p.name for p in paths] == ["scan_heatmap.png", "scan_marey.png"]
    assert all(p.stat().st_size > 0 for p in paths)


def test_heatmap_grid_and_pipeline_order(run_dir):
    events = read_events(run_dir / "trace.json")
    ranks, names, grid = mean_durations(events)
    slowest = ranks[int(grid[:, names.index("backward")].argmax())]
    assert slowest == 6
    assert pipeline_of(events, holding=4) == [0, 4]  # stage 0 then 1 of (dp 0, tp 0)
    assert pipeline_of(events) == [2, 6]  # with no rank named: the slowest rank's pipeline


@pytest.mark.parametrize("argv, field", [
    (["detect", "/no/such/run"], "RUN_DIR_OR_TRACE"),
    (["detect", "{run}", "--method", "oracle"], "--method"),
    (["query", "{run}", "SELEC 1"], "SQL"),
    (["validate-detector", "--trials", "0"], "--trials"),
    (["analyze", "{bad}"], "bad.json: event 1"),
])
def test_bad_input_exits_2_with_one_line(run_dir, tmp_path, capsys, argv, field):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"ph": "X", "name": "k", "pid": 0, "ts": 0, "dur": 1},
                               {"ph": "X", "name": "k", "pid": 0, "ts": 0}]))
    argv = [a.format(run=run_dir, bad=bad) for a in argv]
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and field in err and "Traceback" not in err


def test_reading_a_run_says_what_it_does(run_dir):
    from megatronapp.scan.align.inputs import load_scan_input

    phases: list[str] = []
    scan = load_scan_input(run_dir, phases.append)
    assert phases == [f"loading {run_dir / 'trace.parquet'}", "linking sync ops",
                      "aligning 8 clocks"]
    assert len(scan.clocks) == 8


def test_a_profiler_traces_heat_map_has_a_column_per_op_class_not_per_step() -> None:
    """torch.profiler names every iteration ``ProfilerStep#N`` and wraps backward
    ops in autograd's name: the heat map pools them into classes, and keeps at
    most MAX_COLUMNS columns, pooling the ops with the least time."""
    from megatronapp.scan.plots import MAX_COLUMNS, OTHER_OPS
    from megatronapp.trace.events import Event

    def ev(name: str, dur_s: float) -> Event:
        return Event(name=name, start_s=0.0, dur_s=dur_s, args={})

    steps = [ev(f"ProfilerStep#{i}", 1.0) for i in range(2, 12)]
    backward = [ev("autograd::engine::evaluate_function: ReluBackward0", 0.1)] * 3
    many = [ev(f"aten::op{i}", 1e-3 * (i + 1)) for i in range(40)]
    ranks, names, grid = mean_durations({0: steps + backward + many, 1: steps + many})
    assert len(names) == MAX_COLUMNS and {"ProfilerStep", "ReluBackward0", OTHER_OPS} <= set(names)
    assert "aten::op0" not in names and "aten::op39" in names  # the least time is pooled
    assert grid[0, names.index("ProfilerStep")] == pytest.approx(1e3)
    assert np.isnan(grid[1, names.index("ReluBackward0")])
