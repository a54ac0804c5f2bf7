"""Errors that suggest the fix: the closest valid name, or the valid choices."""
from pathlib import Path

import pytest

from megatronapp.scenario.config import ScenarioError, parse_scenario
from megatronapp.io.suggest import closest, hint

from .support import ROOT, run_cli


@pytest.mark.parametrize("data,field,suggested", [
    ({"iteration": 3}, "iteration", "'iterations'"),
    ({"parallel": {"tpp": 2}}, "parallel.tpp", "'tp'"),
    ({"model": {"hiden": 64}}, "model.hiden", "'hidden'"),
    ({"cluster": {"gpu": {"tflop": 3}}}, "cluster.gpu.tflop", "'tflops'"),
    ({"faults": [{"kind": "throttle", "rank": 0, "factr": 2}]}, "faults[0].factr", "'factor'"),
    ({"faults": [{"kind": "throttel", "rank": 0}]}, "faults[0].kind", "'throttle'"),
    ({"schedule": "1f1c"}, "schedule", "'1f1b'"),
    ({"training": {"recompute": "ful"}}, "training.recompute", "'full'"),
])
def test_a_mistyped_name_names_the_closest_valid_one(data: dict, field: str,
                                                     suggested: str) -> None:
    with pytest.raises(ScenarioError) as err:
        parse_scenario(data)
    assert err.value.field == field
    assert f"did you mean {suggested}?" in err.value.reason


def test_a_name_like_none_lists_the_choices() -> None:
    with pytest.raises(ScenarioError) as err:
        parse_scenario({"faults": [{"kind": "meteor", "rank": 0}]})
    assert "did you mean" not in err.value.reason
    assert "kinds: throttle, slow_link, link_jitter, clock_skew" in err.value.reason
    with pytest.raises(ScenarioError) as err:
        parse_scenario({"parallel": {"zzzz": 1}})
    assert "keys: " in err.value.reason and "microbatches" in err.value.reason


def test_closest_only_suggests_what_is_close() -> None:
    assert closest("detct", ["run", "detect", "plot"]) == "detect"
    assert closest("zzz", ["run", "detect", "plot"]) is None
    assert hint("zzz", ["a1", "b2"], "kinds") == "kinds: a1, b2"


def test_run_on_a_run_directory_points_at_detect(tmp_path: Path) -> None:
    out = tmp_path / "res"
    scenario = ROOT / "scenarios" / "throttle.yaml"
    assert run_cli("run", str(scenario), "--out", str(out)).returncode == 0
    for target, words in [(out, "is a run directory; `run` takes a scenario file"),
                          (out / "trace.json", "is a trace, not a scenario"),
                          (tmp_path, "is a directory; `run` takes a scenario file")]:
        result = run_cli("run", str(target))
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], result.stderr
    assert "did you mean `megatronapp detect" in run_cli("run", str(out)).stderr


def test_a_mistyped_command_or_choice_names_the_closest() -> None:
    result = run_cli("detct", "x")
    assert result.returncode == 2 and "did you mean 'detect'?" in result.stderr
    result = run_cli("run", "x.yaml", "--backend", "torhc")
    assert result.returncode == 2 and "did you mean 'torch'?" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["detect", "analyze", "align"])
def test_a_scenario_given_to_a_trace_command_points_at_run(command: str) -> None:
    scenario = ROOT / "scenarios" / "throttle.yaml"
    result = run_cli(command, str(scenario))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "is a scenario file, not a trace" in lines[0]
    assert f"did you mean `megatronapp run {scenario}`" in lines[0]


def test_a_short_name_suggests_the_choice_it_begins_not_a_lookalike() -> None:
    """``h100`` is closer by letters to ``h200`` than to ``h100-sxm``; a user
    typing the start of a name means that name."""
    with pytest.raises(ScenarioError) as err:
        parse_scenario({"cluster": {"gpu": "h100"}})
    assert err.value.field == "cluster.gpu.device"
    assert "did you mean 'h100-sxm'?" in err.value.reason
    # two names begin with the word: fall back to the most similar one
    assert closest("a", ["ab", "ac", "zz"]) in ("ab", "ac")
