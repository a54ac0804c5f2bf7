"""Pipeline-only jobs: stages do unequal work (the last one computes the
output layer), so MegaScan compares them per unit of the work each op models."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatronapp.cli import main
from megatronapp.scenario.config import Scenario, parse_scenario
from megatronapp.costs.per_op import stage_costs
from megatronapp.scan.evidence.detect import megascan
from megatronapp.scan.align.inputs import load_scan_input, load_table_scan
from megatronapp.scan.eval.validate import scan_of_result
from megatronapp.scan.ingest.work import modelled_work, scenario_of_run
from sim import run_sim

PP = 4


def _pipeline(faults: list[dict], seed: int = 3) -> Scenario:
    """No TP or DP peers; a large vocabulary doubles the last stage's forward."""
    return parse_scenario({
        "seed": seed, "iterations": 2, "schedule": "1f1b",
        "parallel": {"tp": 1, "pp": PP, "dp": 1, "microbatches": 2 * PP},
        "model": {"layers": 8, "hidden": 1024, "heads": 16, "seq_len": 1024, "vocab": 51200},
        "cluster": {"jitter": {"compute_sigma": 0.03, "link_sigma": 0.05}},
        "faults": faults + [{"kind": "clock_skew", "rank": 2, "offset_us": 3000}]})


def _causes(s: Scenario, known: bool = True) -> list[tuple[int, str]]:
    d = megascan(scan_of_result(run_sim(s), scenario=s if known else None))
    return [(c.rank, c.kind) for c in d.root_causes]


def test_modelled_work_is_the_cost_model_per_op_name():
    s = _pipeline([])
    work = modelled_work(s, range(PP))
    costs = stage_costs(s)
    for rank in range(1, PP - 1):  # interior stages: one chunk's layers, nothing else
        assert work[rank]["forward"] == pytest.approx(costs.forward_chunk_s)
    assert work[PP - 1]["forward"] == pytest.approx(costs.forward_chunk_s + costs.logits_forward_s)
    assert work[PP - 1]["forward"] > 1.5 * work[1]["forward"]  # what raw durations would blame


@pytest.mark.parametrize("schedule, vpp, tp, dp", [("1f1b", 1, 2, 3), ("interleaved", 2, 2, 2),
                                                   ("gpipe", 1, 1, 4), ("dfc", 2, 4, 1)])
def test_each_rank_models_the_work_of_its_own_program(schedule, vpp, tp, dp):
    """A rank's work is worked out from its stage's program once; it is what
    recording that rank's own program gives."""
    from megatronapp.program.ranks import static_compute_ops

    s = parse_scenario({
        "schedule": schedule, "parallel": {"tp": tp, "pp": 2, "dp": dp, "vpp": vpp,
                                           "microbatches": 4},
        "model": {"layers": 4 * vpp, "hidden": 256, "heads": 4, "seq_len": 128,
                  "vocab": 51200}})
    ranks = range(s.world_size + 1)  # one past the job: no work
    every = static_compute_ops(s)
    expected = {r: {} for r in every}
    for r, ops in every.items():
        for name in {op.name for op in ops if op.cost_s > 0}:
            costs = [op.cost_s for op in ops if op.name == name and op.cost_s > 0]
            expected[r][name] = sum(costs) / len(costs)
    assert modelled_work(s, ranks) == expected


def test_a_healthy_pipeline_with_a_heavy_last_stage_is_healthy():
    s = _pipeline([])
    assert _causes(s) == []
    # without the work model the end stages go unjudged on compute (raw
    # durations would blame the last one): healthy too
    assert _causes(s, known=False) == []


@pytest.mark.parametrize("rank", [0, 1, PP - 1])
def test_a_throttled_stage_is_named_whatever_its_work(rank):
    assert _causes(_pipeline([{"kind": "throttle", "rank": rank, "factor": 1.3}])) == [
        (rank, "compute")]


def test_no_scenario_or_a_dynamic_one_models_no_work():
    s = _pipeline([])
    assert modelled_work(None, range(PP)) == {}
    assert modelled_work(s.model_copy(update={"schedule": "adaptive"}), range(PP)) == {}


def test_a_run_directory_brings_its_scenario_to_both_detectors(tmp_path: Path, capsys):
    scenario = tmp_path / "pipeline.yaml"
    scenario.write_text(_pipeline([]).model_dump_json())
    run_dir = tmp_path / "run"
    assert main(["run", str(scenario), "--out", str(run_dir), "--quiet"]) == 0
    known = scenario_of_run(run_dir)  # the cost model, never what was injected
    assert known is not None and not known.faults
    assert known == _pipeline([]).model_copy(update={"faults": known.faults})
    assert megascan(load_scan_input(run_dir)).healthy
    assert megascan(load_table_scan(run_dir / "trace.parquet")).healthy
    (run_dir / "summary.json").write_text('{"scenario": {"parallel": {"pp": "four"}}}')
    assert scenario_of_run(run_dir) is None  # an invalid record is no scenario, not a crash


def test_detect_takes_the_scenario_a_trace_does_not_record(tmp_path: Path, capsys):
    # the last stage throttled: only a model of each stage's work lets its
    # compute be judged against stages that do other work
    scenario = tmp_path / "pipeline.yaml"
    scenario.write_text(_pipeline([{"kind": "throttle", "rank": PP - 1, "factor": 1.3}])
                        .model_dump_json())
    run_dir = tmp_path / "run"
    assert main(["run", str(scenario), "--out", str(run_dir), "--quiet"]) == 0
    (run_dir / "summary.json").unlink()  # a trace that records no scenario
    answers = []
    for extra in ([], ["--scenario", str(scenario)]):
        capsys.readouterr()
        assert main(["detect", str(run_dir), "--json", *extra]) == 0
        answers.append([(c["rank"], c["kind"])
                        for c in json.loads(capsys.readouterr().out)["root_causes"]])
    assert answers == [[], [(PP - 1, "compute")]]
    assert main(["detect", str(run_dir), "--scenario", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("megatronapp: --scenario: ") and "missing.yaml" in err
