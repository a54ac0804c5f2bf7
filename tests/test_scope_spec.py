"""The scope: section is validated like the rest of a scenario: one line naming
the field, exit status 2 from the CLI, nothing written."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from megatronapp.scenario.config import ScenarioError, parse_scenario
from megatronapp.scenario.scope_spec import parse_stat
from tests.support import run_cli

MODEL = {"layers": 2, "hidden": 32, "heads": 4, "seq_len": 8, "vocab": 64}


def scenario(scope: dict[str, Any], pp: int = 2, tp: int = 1) -> Any:
    return parse_scenario({"parallel": {"pp": pp, "tp": tp}, "model": MODEL, "scope": scope})


BAD = [
    ({"observe": [{"site": "resid_sideways"}]}, "scope.observe[0].site", "unknown site"),
    ({"observe": [{"site": "resid_pre", "stats": ["median"]}]}, "scope.observe[0].stats",
     "unknown statistic"),
    ({"observe": [{"site": "resid_pre", "stats": ["mean(3)"]}]}, "scope.observe[0].stats",
     "takes no argument"),
    ({"observe": [{"site": "resid_pre", "stats": ["__import__('os')"]}]}, "scope.observe[0].stats",
     "unknown statistic"),
    ({"observe": [{"site": "mlp.pre", "layers": [3]}]}, "scope.observe[0].layers",
     "beyond the model's 2 layers"),
    ({"observe": [{"site": "attn.q", "heads": [4]}]}, "scope.observe[0].heads", "out of range"),
    ({"observe": [{"site": "resid_pre", "heads": [0]}]}, "scope.observe[0].heads", "has no heads"),
    ({"observe": [{"site": "resid_pre", "stats": ["entropy"]}]}, "scope.observe[0].stats",
     "attn.probs only"),
    ({"observe": [{"site": "resid_pre", "stats": ["pixels_mean(5)"]}]}, "scope.observe[0].stats",
     "does not divide"),
    ({"observe": [{"site": "resid_pre", "tokens": [9]}]}, "scope.observe[0].tokens", "out of range"),
    ({"observe": [{"site": "resid_pre", "colour": "red"}]}, "scope.observe[0].colour", "unknown key"),
    ({"perturb": [{"kind": "cosmic_ray"}]}, "scope.perturb[0].kind",
     "unknown perturbation kind 'cosmic_ray'"),
    ({"perturb": [{"kind": "param_bitflip", "target": "mlp.linear_fc3.weight", "layers": [1],
                   "bit": 3}]}, "scope.perturb[0].target", "no parameter"),
    ({"perturb": [{"kind": "param_bitflip", "target": "output_layer.weight", "bit": 32}]},
     "scope.perturb[0].bit", "out of range for 32-bit"),
    ({"perturb": [{"kind": "param_stuck", "target": "output_layer.weight", "value": 1,
                   "index": 64 * 32}]}, "scope.perturb[0].index", "out of range"),
    ({"perturb": [{"kind": "param_noise", "target": "mlp.linear_fc1.weight", "layers": [5],
                   "sigma": 0.1}]}, "scope.perturb[0].layers", "beyond"),
    ({"perturb": [{"kind": "act_noise", "site": "resid_mid", "sigma": 1.0}]},
     "scope.perturb[0].site", "observed, not perturbed"),
    ({"perturb": [{"kind": "act_mask", "site": "mlp.pre", "channels": [128]}]},
     "scope.perturb[0].channels", "out of range"),
    ({"perturb": [{"kind": "p2p_offset", "direction": "forward", "stage": 0, "value": 1}]},
     "scope.perturb[0].stage", "no stage 0 receives forward"),
    ({"perturb": [{"kind": "p2p_zero", "direction": "sideways"}]}, "scope.perturb[0].direction",
     "Input should be"),
    ({"perturb": [{"kind": "quantize", "site": "logits", "format": "fp4"}]},
     "scope.perturb[0].format", "Input should be"),
]


@pytest.mark.parametrize("scope, field, reason", BAD)
def test_bad_scope_names_the_field(scope: dict[str, Any], field: str, reason: str) -> None:
    with pytest.raises(ScenarioError) as err:
        scenario(scope)
    assert err.value.field == field
    assert reason in err.value.reason


def test_pipeline_perturbation_needs_a_pipeline() -> None:
    with pytest.raises(ScenarioError, match="one stage sends nothing"):
        scenario({"perturb": [{"kind": "p2p_noise", "direction": "backward", "sigma": 1}]}, pp=1)


def test_scope_with_fbd_is_refused() -> None:
    with pytest.raises(ScenarioError, match="scope"):
        parse_scenario({"model": MODEL, "fbd": {}, "scope": {"observe": [{"site": "logits"}]}})


def test_good_scope_parses_and_canonicalises_statistics() -> None:
    s = scenario({"observe": [{"site": "attn.probs", "stats": ["entropy", "topk(3)",
                                                                "sparsity(1e-3)"]},
                              {"site": "grad:mlp.pre", "layers": [2], "tokens": [-1]}],
                  "perturb": [{"kind": "param_bitflip", "target": "mlp.linear_fc1.weight",
                               "layers": [2], "bit": "sign", "index": 5},
                              {"kind": "p2p_offset", "direction": "forward", "value": 0.5}]},
                 tp=2)
    assert s.scope is not None
    assert s.scope.observe[0].stats == ("entropy", "topk(3)", "sparsity(0.001)")
    assert parse_stat("pixels_absmax( 4 )").label == "pixels_absmax(4)"


def test_cli_bad_scope_exits_2_with_one_line_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"parallel": {"pp": 2}, "model": MODEL,
                                    "scope": {"observe": [{"site": "resid_pre", "layers": [7]}]}}))
    out = tmp_path / "run"
    res = run_cli("run", str(path), "--out", str(out), "--quiet")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0
    assert "scope.observe[0].layers" in res.stderr and "Traceback" not in res.stderr
    assert not out.exists() and not list(tmp_path.glob(".run*"))
