"""Scenario validation: every bad-input rule, via the API and the real CLI."""
from pathlib import Path

import pytest
import yaml

from megatronapp.scenario.config import ScenarioError, apply_overrides, load_scenario, parse_scenario

from .support import ROOT, run_cli

GOOD = {"seed": 1, "iterations": 1, "schedule": "1f1b",
        "parallel": {"tp": 1, "pp": 2, "dp": 2, "microbatches": 4},
        "model": {"layers": 4, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 128},
        "costs": {"forward_s": 0.001, "backward_s": 0.002}}

# (mutation of GOOD, field named in the error, words in the reason)
BAD = [
    ({"bogus": 1}, "bogus", "unknown key"),
    ({"parallel": {"tp": 1, "pp": 2, "dp": 2, "microbatches": 4, "colour": 3}},
     "parallel.colour", "unknown key"),
    ({"iterations": "many"}, "iterations", "integer"),
    ({"parallel": {"tp": "two"}}, "parallel.tp", "integer"),
    ({"schedule": "zigzag"}, "schedule", "gpipe"),
    ({"cluster": {"nodes": 3, "gpus_per_node": 8}}, "parallel", "tp*pp*dp = 4"),
    ({"model": {"layers": 5, "hidden": 64, "heads": 4}}, "model.layers", "not divisible by pp*vpp"),
    ({"schedule": "interleaved", "parallel": {"pp": 2, "vpp": 3, "microbatches": 4},
      "model": {"layers": 8, "hidden": 64, "heads": 4}}, "model.layers", "pp*vpp = 6"),
    ({"parallel": {"tp": 2, "pp": 2, "microbatches": 4},
      "model": {"layers": 4, "hidden": 96, "heads": 3}}, "model.heads", "not divisible by tp"),
    ({"faults": [{"kind": "meteor", "rank": 0}]}, "faults[0].kind", "unknown fault kind"),
    ({"faults": [{"kind": "throttle", "rank": 9, "factor": 2}]}, "faults[0].rank", "out of range"),
    ({"faults": [{"kind": "slow_link", "ranks": [0, 7], "factor": 2}]}, "faults[0].ranks",
     "out of range"),
    ({"faults": [{"kind": "slow_link", "ranks": [1, 1], "factor": 2}]}, "faults[0].ranks",
     "two different"),
    ({"faults": [{"kind": "throttle", "rank": 0, "factor": 2, "speed": 1}]}, "faults[0].speed",
     "unknown key"),
    ({"faults": [{"kind": "throttle", "rank": 0, "factor": 2, "start_s": 2, "end_s": 1}]},
     "faults[0].end_s", "later"),
    ({"faults": [{"kind": "slow_link", "ranks": [0, 1], "factor": 2, "start_s": 2, "end_s": 1}]},
     "faults[0].end_s", "later"),
    ({"faults": [{"kind": "slow_link", "ranks": [0, 1], "factor": 2, "start_s": -1}]},
     "faults[0].start_s", "greater than or equal to 0"),
    ({"parallel": {"pp": 2, "dp": 2, "microbatches": 0}}, "parallel.microbatches", "greater than or equal to 1"),
    ({"schedule": "1f1b", "parallel": {"pp": 2, "vpp": 2, "microbatches": 4}},
     "parallel.vpp", "interleaved"),
]


def mutate(change: dict) -> dict:
    data = {**GOOD}
    data.update(change)
    return data


@pytest.mark.parametrize("change,field,reason", BAD)
def test_bad_scenario_names_the_field(change: dict, field: str, reason: str) -> None:
    with pytest.raises(ScenarioError) as err:
        parse_scenario(mutate(change))
    assert err.value.field == field
    assert reason in err.value.reason


def test_good_scenario_parses() -> None:
    s = parse_scenario(GOOD)
    assert s.world_size == 4 and s.parallel.group_size == 2


@pytest.mark.parametrize("change,field,reason", BAD[:11])
def test_cli_bad_input_exits_2_with_one_line(tmp_path: Path, change: dict, field: str,
                                             reason: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(mutate(change)))
    out_dir = tmp_path / "out"
    result = run_cli("run", str(path), "--out", str(out_dir))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in result.stderr
    assert not out_dir.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_unreadable_file(tmp_path: Path) -> None:
    result = run_cli("run", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "o"))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "missing.yaml: no such file" in line and "scenario" in line


def test_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("parallel: {tp: [1\n")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(path)


def test_set_overrides_any_key(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    s = load_scenario(path, ["parallel.dp=1", "cluster.links.latency_us=7.5",
                             "faults=[{kind: throttle, rank: 1, factor: 2}]",
                             "faults.0.factor=3"])
    assert s.parallel.dp == 1 and s.cluster.links.latency_us == 7.5
    assert s.faults[0].factor == 3


def test_set_override_is_validated(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    result = run_cli("run", str(path), "--set", "parallel.pp=3", "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and "model.layers" in result.stderr
    with pytest.raises(ScenarioError, match="--set"):
        apply_overrides(GOOD, ["no-equals-sign"])


def test_shipped_scenarios_are_valid() -> None:
    for path in sorted((ROOT / "scenarios").glob("*.yaml")):
        load_scenario(path)


def test_readme_scenario_example_is_valid() -> None:
    import re

    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", readme, re.S)
    assert block is not None
    assert parse_scenario(yaml.safe_load(block.group(1))).world_size == 16
