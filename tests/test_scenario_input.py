"""Scenario input discipline: finite numbers, any seed, encodings, nesting,
duplicate keys, empty files and booleans are each one line or a valid run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatronapp.cli import main
from megatronapp.scenario.config import ScenarioError, load_scenario, parse_scenario
from megatronapp.scenario.seeds import entropy, rng, torch_seed

BASE = ("name: tiny\nparallel: {pp: 2, dp: 2, microbatches: 2}\n"
        "model: {layers: 2, hidden: 64, heads: 2, seq_len: 64, vocab: 128}\n")


def _run(capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str | bytes,
         *sets: str) -> tuple[int, list[str], Path]:
    path = tmp_path / "s.yaml"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    out = tmp_path / "out"
    code = main(["run", str(path), "--out", str(out), "--quiet",
                 *[arg for s in sets for arg in ("--set", s)]])
    return code, capsys.readouterr().err.strip().splitlines(), out


def _refused(capsys, tmp_path, text, *sets, field: str) -> str:
    code, err, out = _run(capsys, tmp_path, text, *sets)
    assert code == 2 and len(err) == 1 and field in err[0], err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["s.yaml"]
    return err[0]


@pytest.mark.parametrize("key,value", [
    ("cluster.gpu.memory_gb", ".inf"), ("cluster.gpu.tflops", ".nan"),
    ("cluster.links.inter_node_gbps", ".inf"), ("cluster.links.latency_us", ".nan"),
    ("costs.forward_s", ".inf"), ("costs.backward_s", ".nan"),
    ("cluster.gpu.memory_gb", "1e300"), ("costs.optimizer_s", "-1e-3"),
])
def test_non_finite_or_absurd_numbers_name_the_field(capsys, tmp_path, key, value):
    _refused(capsys, tmp_path, BASE, f"{key}={value}", field=key)


@pytest.mark.parametrize("fault,field", [
    ("{kind: clock_skew, rank: 1, drift_ppm: .inf}", "faults[0].drift_ppm"),
    ("{kind: clock_skew, rank: 1, offset_us: .nan}", "faults[0].offset_us"),
    ("{kind: throttle, rank: 1, factor: 2, start_s: .nan}", "faults[0].start_s"),
    ("{kind: throttle, rank: 1, factor: 2, end_s: .inf}", "faults[0].end_s"),
    ("{kind: slow_link, ranks: [0, 1], factor: .inf}", "faults[0].factor"),
    ("{kind: slow_link, ranks: [true, 1], factor: 2}", "faults[0].ranks[0]"),
])
def test_non_finite_fault_fields_name_the_field(capsys, tmp_path, fault, field):
    _refused(capsys, tmp_path, BASE, f"faults=[{fault}]", field=field)


def test_factors_that_multiply_past_the_range_are_refused(capsys, tmp_path):
    faults = ", ".join(["{kind: slow_link, ranks: [0, 1], factor: 1000}"] * 3)
    assert "multiply" in _refused(capsys, tmp_path, BASE, f"faults=[{faults}]",
                                  field="faults[2].factor")
    sequential = [{"kind": "throttle", "rank": 0, "factor": 1000, "start_s": i, "end_s": i + 1}
                  for i in range(5)]  # one after the other: never more than 1000x
    s = parse_scenario({**_base_dict(), "faults": sequential})
    assert len(s.faults) == 5


def _base_dict() -> dict:
    import yaml

    return yaml.safe_load(BASE)


def test_summary_is_strict_json_when_everything_takes_no_time(capsys, tmp_path):
    code, err, out = _run(capsys, tmp_path, BASE, "costs={forward_s: 0, backward_s: 0, "
                          "p2p_s: 0, allreduce_s: 0, optimizer_s: 0}")
    assert code == 0, err

    def refuse(name: str) -> None:
        raise ValueError(f"{name} in summary.json")

    summary = json.loads((out / "summary.json").read_text(), parse_constant=refuse)
    assert summary["iteration_times_s"] == [0.0]


@pytest.mark.parametrize("seed", ["-1", "-123456789", str(2**200), str(-(2**70))])
def test_any_integer_seed_runs_with_jitter_and_faults(capsys, tmp_path, seed):
    sets = (f"seed={seed}", "cluster.jitter={compute_sigma: 0.1, link_sigma: 0.1}",
            "faults=[{kind: link_jitter, ranks: [0, 1], sigma: 0.5}]")
    code, err, out = _run(capsys, tmp_path, BASE, *sets)
    assert code == 0, err
    first = json.loads((out / "summary.json").read_text())["iteration_times_s"]
    assert main(["run", str(tmp_path / "s.yaml"), "--out", str(out), "--quiet", "--force",
                 *[a for s in sets for a in ("--set", s)]]) == 0
    assert json.loads((out / "summary.json").read_text())["iteration_times_s"] == first


def test_seed_mapping_is_deterministic_and_separates_signs():
    assert entropy(5, 3) == [5, 3]  # non-negative seeds keep their streams
    draws = {s: rng(s, 1).random() for s in (-5, 5, -6, 2**100, -(2**100))}
    assert len(set(draws.values())) == len(draws)
    assert rng(-5, 1).random() == draws[-5]
    assert torch_seed(7) == 7 and 0 <= torch_seed(-7) < 2**62 and 0 <= torch_seed(2**80) < 2**62


def test_negative_seeds_reach_the_other_commands(capsys, tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(BASE + "cluster: {jitter: {compute_sigma: 0.1}}\n")
    assert main(["dpp", "compare", str(path), "--set", "seed=-1",
                 "--schedules", "1f1b"]) == 0, capsys.readouterr().err
    fbd = Path(__file__).resolve().parents[1] / "scenarios" / "fbd_hetero.yaml"
    assert main(["fbd-compare", str(fbd), "--set", "seed=-3", "--set", "iterations=1",
                 "--set", "cluster.jitter.compute_sigma=0.05"]) == 0, capsys.readouterr().err
    assert main(["validate-detector", "--seed", "-1", "--trials", "1",
                 "--csv", str(tmp_path / "v.csv")]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("content,words", [
    ("name: caf\xe9\n".encode("latin-1"), "not UTF-8"),
    ("name: a\n".encode("utf-16"), "UTF-16"),
    (b"\x00\x01\x02\xff\xfe\x00binary", "not UTF-8"),
    (b"", "empty"), (b"   \n# only a comment\n", "empty"),
    ("a: " + "[" * 3000 + "]" * 3000, "nested"),
    ("a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 200)) + "  " * 200 + "v: 1\n",
     "nested"),
    ("name: a\nseed: 1\nname: b\n", "duplicate key 'name'"),
    ("parallel: {pp: 2, pp: 4}\n", "duplicate key 'pp'"),
    ("iterations: true\n", "iterations"),
    ("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi")),
     "expands"),
    ("seed: " + "9" * 5000 + "\n", "not valid YAML"),
])
def test_unreadable_scenarios_are_one_line(capsys, tmp_path, content, words):
    assert words in _refused(capsys, tmp_path, content, field="")


def test_dev_null_is_an_empty_scenario(capsys, tmp_path):
    out = tmp_path / "out"
    code = main(["run", "/dev/null", "--out", str(out), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "empty" in err[0] and not out.exists()


@pytest.mark.parametrize("override", [
    "name=" + "[" * 3000 + "]" * 3000,
    ".".join(["k"] * 3000) + "=1",
])
def test_deep_overrides_are_one_line(capsys, tmp_path, override):
    assert "nested" in _refused(capsys, tmp_path, BASE, override, field="")


def test_a_bool_is_not_a_count(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(BASE + "iterations: true\n")
    with pytest.raises(ScenarioError) as err:
        load_scenario(path)
    assert err.value.field == "iterations" and "true" in err.value.reason
