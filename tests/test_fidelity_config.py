"""Megatron-core's options in scenarios: each validated like the rest."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from megatronapp.scenario.config import ScenarioError, adjustments, parse_scenario

from .support import run_cli

GOOD: dict[str, Any] = {
    "parallel": {"tp": 2, "pp": 2, "dp": 2, "microbatches": 4},
    "model": {"layers": 4, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 128},
}


def with_(section: str, **values: Any) -> dict[str, Any]:
    data = json.loads(json.dumps(GOOD))
    data.setdefault(section, {}).update(values)
    return data


# (scenario, field named, words in the reason) -- each a combination Megatron-LM rejects
BAD = [
    (with_("training", overlap_param_gather=True, overlap_grad_reduce=True),
     "training.overlap_param_gather", "distributed_optimizer"),
    (with_("training", overlap_param_gather=True, distributed_optimizer=True),
     "training.overlap_param_gather", "overlap_grad_reduce"),
    (with_("model", num_query_groups=3), "model.num_query_groups", "does not divide heads"),
    (with_("model", num_query_groups=1), "model.num_query_groups", "not divisible by tp"),
    (with_("model", ffn_hidden_size=129), "model.ffn_hidden_size", "not divisible by tp"),
    (with_("model", seq_len=33, hidden=64) | {"parallel": {**GOOD["parallel"],
                                                          "sequence_parallel": True}},
     "model.seq_len", "sequence parallelism"),
    (with_("training", precision="fp32", grad_reduce_in_fp32=True),
     "training.grad_reduce_in_fp32", "fp32"),
    (with_("training", recompute="sometimes"), "training.recompute", "none"),
    (with_("training", precision="fp8"), "training.precision", "bf16"),
    (with_("model", activation="relu"), "model.activation", "gelu"),
    (with_("training", bucket_params=0), "training.bucket_params", "greater than"),
    (with_("cluster", gpu={"gemm_overhead_us": -1}), "cluster.gpu.gemm_overhead_us",
     "greater than"),
    (with_("cluster", links={"nics_per_node": 0}), "cluster.links.nics_per_node",
     "greater than"),
    (with_("training", remat=True), "training.remat", "unknown key"),
]


@pytest.mark.parametrize("data,field,words", BAD)
def test_rejected_combination_names_its_field(data: dict, field: str, words: str) -> None:
    with pytest.raises(ScenarioError) as err:
        parse_scenario(data)
    assert err.value.field == field and words in err.value.reason


def test_cli_rejects_overlap_param_gather_without_distributed_optimizer(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(with_("training", overlap_param_gather=True,
                                         overlap_grad_reduce=True)))
    for command in (["run", str(path), "--out", str(tmp_path / "out")], ["predict", str(path)]):
        proc = run_cli(*command)
        assert proc.returncode == 2 and not (tmp_path / "out").exists()
        (line,) = proc.stderr.strip().splitlines()
        assert "training.overlap_param_gather" in line


def test_megatron_names_and_ours_both_read() -> None:
    a = parse_scenario(with_("model", ffn_hidden_size=96))
    b = parse_scenario(with_("model", ffn_hidden=96))
    assert a.model.ffn == b.model.ffn == 96
    swiglu = parse_scenario(with_("model", activation="swiglu", hidden=96, heads=4))
    assert swiglu.model.ffn == 256  # Megatron's default: 8h/3 rounded down to 64


def test_sequence_parallel_at_tp_1_is_turned_off_and_said_so(tmp_path: Path) -> None:
    data = json.loads(json.dumps(GOOD))
    data["parallel"].update(tp=1, sequence_parallel=True)
    s = parse_scenario(data)
    assert not s.sequence_parallel and adjustments(s)
    path = tmp_path / "sp.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = run_cli("run", str(path), "--out", str(tmp_path / "run"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "sequence_parallel is off: tp = 1" in proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["adjustments"] == adjustments(s)
    assert not adjustments(parse_scenario(GOOD))


def test_recompute_true_or_false_reads_as_full_or_none() -> None:
    """Scenarios written for the torch backend's boolean ``recompute`` still load."""
    assert parse_scenario(with_("training", recompute=True)).training.recompute == "full"
    assert parse_scenario(with_("training", recompute=False)).training.recompute == "none"
