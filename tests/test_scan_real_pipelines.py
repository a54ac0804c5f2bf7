"""MegaScan on kept real runs of this project's pipelines (torch backend,
gloo, pp 4, a loaded 2-core machine): the run's scenario says what work each
stage models, so a middle stage whose main op alone ran 1.24-1.39x its
peer's on a healthy run is not named on its receive time; a throttled stage
still is. Each trace is a kept ``validate-detector --backend torch`` trial,
scored as ``--replay`` scores it."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from megatronapp.scan.evidence.detect import megascan
from megatronapp.scan.align.inputs import prepare_loaded
from megatronapp.scan.ingest.load import load_trace
from megatronapp.scan.eval.trials import PLANS

KEPT = Path(__file__).parent / "data" / "real_trials"


def diagnosis_of(name: str):
    run_dir = KEPT / name
    meta = json.loads((run_dir / "trial.json").read_text())
    trial = PLANS[meta["plan"]].make(int(meta["seed"]), int(meta["index"]))
    return megascan(replace(prepare_loaded(load_trace(run_dir)), scenario=trial.scenario))


@pytest.mark.parametrize("name", ["healthy_pp4", "healthy_pp4_b", "healthy_pp4_c"])
def test_a_healthy_real_pipeline_with_modelled_work_names_nobody(name):
    assert [(c.kind, c.rank) for c in diagnosis_of(name).root_causes] == []


def test_a_throttled_real_stage_is_named_first_with_the_others_waiting_for_it():
    truth = json.loads((KEPT / "throttled_stage1_pp4" / "ground_truth.json").read_text())
    throttled = next(f["rank"] for f in truth["faults"] if f["kind"] == "throttle")
    first = diagnosis_of("throttled_stage1_pp4").root_causes[0]
    assert (first.kind, first.rank) == ("compute", throttled)
    d = diagnosis_of("throttled_stage1_pp4")
    assert set(d.victims) == {0, 1, 2, 3} - {throttled}  # every other stage waited for it


@pytest.mark.parametrize("name", ["healthy_pp4", "healthy_pp4_b", "healthy_pp4_c"])
def test_without_modelled_work_a_healthy_trace_still_names_nobody(name):
    """Stages without peers are then judged against their own iterations."""
    named = megascan(prepare_loaded(load_trace(KEPT / name))).root_causes
    assert [(c.kind, c.rank) for c in named] == []
