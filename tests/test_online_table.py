"""``experiments/online_table.py``: the false-alarm rate's upper bound, and how
a kept torch run is scored. The scored runs here are simulated (the same
scenario, a run directory like a torch run's) so that the fault's timing is
known; the table's own runs are real."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from experiments import online_table as table
from experiments.results import read
from megatronapp.scenario.config import Scenario
from sim import simulate


def kept(tmp: Path, s: Scenario, forward_s: float = 0.005) -> Path:
    """A kept run of ``s``; computes of ``forward_s`` (backward twice that) put
    the throttle's onset a few iterations in."""
    s = s.model_copy(update={"costs": s.costs.model_copy(
        update={"forward_s": forward_s, "backward_s": 2 * forward_s})})
    out = tmp / "run"
    out.mkdir(parents=True)
    table.write_run(s, simulate(s), out)
    (out / "load.txt").write_text("1.0\n")
    return out


def test_a_throttle_is_timed_from_its_onset_and_a_healthy_run_names_nobody(tmp_path: Path
                                                                          ) -> None:
    throttled = table.score_torch_run(
        kept(tmp_path / "t", table.torch_scenario(4, "throttle", 3.0, 0)), "throttle", 4)
    assert throttled.latency is not None and 1 <= throttled.latency <= 5
    assert throttled.wrong == 0 and throttled.correct_at_end
    assert throttled.iterations == table.TORCH_ITERATIONS
    healthy = table.score_torch_run(
        kept(tmp_path / "h", table.torch_scenario(4, "healthy", 0.0, 0)), "healthy", 4)
    assert healthy.latency is None and healthy.wrong == 0 and healthy.correct_at_end


def test_naming_the_throttled_rank_before_its_onset_is_a_false_alarm(tmp_path: Path) -> None:
    s = table.torch_scenario(4, "throttle", 3.0, 0)
    early = s.model_copy(update={"faults": (s.faults[0].model_copy(update={"start_s": 0.0}),)})
    scored = table.score_torch_run(kept(tmp_path, early, forward_s=0.001), "throttle", 4)
    assert scored.wrong == 1  # named in the healthy iterations the table expects
    assert scored.latency == 1  # and standing at the end of the onset iteration


@given(exposure=st.floats(1.0, 1e6))
def test_no_event_bounds_the_rate_by_ln_20_over_the_exposure(exposure: float) -> None:
    from experiments.online_table import poisson_upper

    assert poisson_upper(0, exposure) == pytest.approx(math.log(20) / exposure, rel=1e-9)


@given(count=st.integers(0, 30), exposure=st.floats(10.0, 1e5))
def test_at_the_bound_seeing_as_few_events_has_probability_one_in_twenty(
        count: int, exposure: float) -> None:
    from experiments.online_table import poisson_upper

    mean = poisson_upper(count, exposure) * exposure
    at_most = sum(mean ** k / math.factorial(k) for k in range(count + 1)) * math.exp(-mean)
    assert at_most == pytest.approx(0.05, abs=1e-9)
    assert poisson_upper(count + 1, exposure) > poisson_upper(count, exposure) > count / exposure


def test_seeds_place_the_fault_on_different_ranks_links_and_times() -> None:
    s = table.scenario(table.JOBS[1024], 0, 1, "[]")
    places = [table.placed(s, seed) for seed in range(20)]
    assert len({p.rank for p in places}) > 1 and len({p.link for p in places}) > 1
    assert len({p.into for p in places}) == 20  # 20 different runs
    node, stride = s.cluster.gpus_per_node, s.parallel.tp * s.parallel.dp
    for p in places:
        a, b = p.link
        assert 0 <= p.rank < s.world_size and 0 <= a < b < s.world_size
        assert b - a == stride and a // node != b // node  # consecutive stages, two nodes
        assert 0.0 <= p.into < 1.0


@pytest.mark.parametrize("kind", ["throttle", "slow_link"])
def test_a_seed_placed_fault_is_timed_from_its_own_onset(kind: str) -> None:
    job = table.JOBS[16]
    latency, false = table.trial(job, kind, 3.0, 1, table.iteration_s(job))
    assert latency is not None and 1 <= latency <= 3 and false == 0


def test_a_job_without_jitter_names_the_same_on_its_stored_rows_as_on_every_rank() -> None:
    calm = table.Job("scan_1024.yaml", ("parallel.microbatches=8", "cluster.jitter.compute_sigma=0",
                                        "cluster.jitter.link_sigma=0"), 300, (427, 555), 4,
                     jitter=False)
    throttled = table.scenario(calm, 0, 4, "[{kind: throttle, rank: 300, factor: 2.0}]")
    named = table.named_verdicts(throttled, compact=True)  # 32 of 1,024 ranks' rows
    assert named > 0 and named == table.named_verdicts(throttled, compact=False)
    assert table.healthy_verdicts(calm, 0, 4) == 0
    assert table.named_verdicts(table.scenario(calm, 0, 4, "[]"), compact=False) == 0


def test_cases_picks_the_rows_a_replay_scores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(table, "TORCH_OUT", tmp_path)
    for kind, severity in (("throttle", 1.5), ("healthy", 0.0)):
        s = table.torch_scenario(4, kind, severity, 0)
        kept(table.torch_run_dir(4, kind, severity, 0).parent, s)
    monkeypatch.setattr("sys.argv", ["online_table.py", "--backend", "torch", "--replay",
                                     "--seeds", "1", "--cases", "healthy-0",
                                     "--results-dir", str(tmp_path / "results")])
    table.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4 ")]
    assert [r.split(" | ")[1] for r in rows] == ["healthy"]
    # the printed rows are what the results file records, under the backend's part
    recorded = read("online_table", tmp_path / "results")["data"]["parts"]["torch"]["data"]
    assert [cells[:2] for cells in recorded["cells"][1:]] == [["4", "healthy"]]
    assert recorded["args"]["cases"] == "healthy-0"


def test_an_unknown_case_is_one_line_and_status_2(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.argv", ["online_table.py", "--backend", "torch", "--replay",
                                     "--cases", "throttle-9"])
    with pytest.raises(SystemExit) as stop:
        table.main()
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines() == ["online_table.py: --cases: no case throttle-9"]
