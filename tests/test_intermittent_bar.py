"""experiments.intermittent_bar: the statistic an intermittent cause's bar is
read against, and its command's errors."""
from __future__ import annotations

from pathlib import Path

import pytest

from experiments import intermittent_bar
from megatronapp.scan.eval.validate import scan_of_result
from megatronapp.scan.evidence.params import Params
from megatronapp.scenario.config import parse_scenario
from sim import run_sim

JOB = {"seed": 4, "iterations": 6, "parallel": {"tp": 1, "pp": 2, "dp": 4, "microbatches": 4},
       "model": {"layers": 4, "hidden": 512, "heads": 8, "seq_len": 512},
       "cluster": {"jitter": {"compute_sigma": 0.02, "link_sigma": 0.05}}}


def _units(faults: list[dict]) -> float:
    s = parse_scenario({**JOB, "faults": faults})
    return intermittent_bar.second_highest_units(scan_of_result(run_sim(s), scenario=s))


def test_a_throttle_every_other_iteration_stands_past_the_bar_and_a_healthy_job_does_not():
    """A rank throttled 2x in every second iteration is named as intermittent
    (two iterations past ``recur_multiple``); the same job healthy has no
    suspect that far out twice."""
    bar = Params().recur_multiple
    assert _units([{"kind": "throttle", "rank": 3, "factor": 2.0,
                    "every_k_iterations": 2}]) >= bar > _units([])


@pytest.mark.parametrize("argv", [["/nonexistent/set"], ["tests/data/heldout7", "--bars", "5,x"]])
def test_bad_input_is_one_line_and_status_2(argv: list[str], capsys: pytest.CaptureFixture[str]):
    assert intermittent_bar.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("intermittent_bar: ") and "\n" not in err
    assert not Path("results/intermittent_bar.json").exists()
