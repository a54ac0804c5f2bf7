"""Megatron-core's defaults are the simulator's: every row of the one table
(megatronapp/scenario/megatron_defaults.py) is checked against the installed
megatron-core 0.16.1 where it holds the default, against what a scenario that
leaves the key unset does, and ``predict`` lists the defaults a scenario used."""
from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from megatronapp.costs.memory import state_bytes
from megatronapp.fidelity.predict import steady_state_s
from megatronapp.fidelity.published import published_runs
from megatronapp.scenario.config import ScenarioError, parse_scenario
from megatronapp.scenario.megatron_defaults import DEFAULTS, MegatronDefault, unset_keys
from sim import simulate_iteration_times

from .support import ROOT, run_cli

SMALL = {"model": {"layers": 4, "hidden": 512, "heads": 8, "seq_len": 512, "vocab": 1024},
         "parallel": {"tp": 2, "dp": 2, "microbatches": 2}}


def scenario(gpu: Any = None, **sections: Any) -> Any:
    data: dict[str, Any] = {**SMALL, **sections}
    if gpu is not None:
        data["cluster"] = {"gpu": gpu}
    return parse_scenario(data)


def core_default(path: str) -> Any:
    """The default of a dataclass field of the installed megatron-core."""
    module, _, attr = path.partition(":")
    cls_name, field_name = attr.split(".")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no Transformer Engine or Apex here
        cls = getattr(importlib.import_module(module), cls_name)
    return cls.__dataclass_fields__[field_name].default


def as_megatron_states(value: Any) -> Any:
    """An installed default in the table's terms: an enum by its name, a dtype as a precision."""
    if hasattr(value, "name") and not isinstance(value, (str, bool)):
        return value.name
    if str(value) == "torch.float32":
        return "fp32"
    return value


CORE_ROWS = [d for d in DEFAULTS if d.core_field]


@pytest.mark.parametrize("row", CORE_ROWS, ids=[d.key for d in CORE_ROWS])
def test_each_default_the_table_states_is_the_installed_megatron_cores(row: MegatronDefault) -> None:
    assert as_megatron_states(core_default(row.core_field)) == row.megatron


SITE = Path(importlib.util.find_spec("megatron.core").origin).parents[2]  # type: ignore


@pytest.mark.parametrize("row", [d for d in DEFAULTS if d.cited.startswith("megatron/core/")],
                         ids=lambda d: d.key)
def test_a_megatron_core_line_the_table_cites_holds_what_it_mirrors(row: MegatronDefault) -> None:
    """The file and line cited (core_v0.16.1, the installed release) name the field or call."""
    where = row.cited.split(" ")[0]
    path, _, lines = where.partition(":")
    first = int(lines.split("-")[0])
    text = (SITE / path).read_text().splitlines()[first - 1]
    mentions = row.core_field.rsplit(".", 1)[-1] if row.core_field else "async_op=True"
    if row.key == "parallel.microbatch_group_size":
        mentions = "microbatch_group_size_per_vp_stage"
    assert mentions in text, (where, text)


PLAIN = [d for d in DEFAULTS if not d.why and not d.differs
         and (isinstance(d.megatron, (bool, int, float)) or d.megatron is None)]


@pytest.mark.parametrize("row", PLAIN, ids=[d.key for d in PLAIN])
def test_a_key_left_unset_takes_megatrons_plain_default(row: MegatronDefault) -> None:
    for gpu in (None, {"device": "h100-sxm"}):
        value = row.value(scenario(gpu))
        expected = "none" if row.key == "training.recompute" else row.megatron
        assert value == expected, (row.key, gpu)


def test_rows_that_differ_from_megatron_say_why() -> None:
    differing = [d for d in DEFAULTS if d.differs]
    assert [d.key for d in differing] == ["training.precision"]
    assert scenario().training.precision == "bf16" != differing[0].megatron


@pytest.mark.parametrize("gpu, backend", [
    ({"device": "h100-sxm"}, "fused"),  # Transformer Engine prefers cuDNN's on Hopper
    ({"device": "h200"}, "fused"),
    ({"device": "a100-80gb"}, "flash"),
    ({"device": "h100-sxm", "software": "megatron-core-0.8"}, "fused"),
    ({"device": "a100-80gb", "software": "megatron-lm-2021"}, "unfused"),  # no TE in 2021
    (None, "unfused"),  # no GPU named: the torch backend's local attention
])
def test_attention_auto_is_what_transformer_engine_picks_there(gpu: Any, backend: str) -> None:
    s = scenario(gpu)
    assert s.model.attention_backend is None and s.attention_backend == backend
    assert s.stores_scores == (backend == "unfused")


def test_attention_auto_on_an_h100_is_priced_as_fused_attention() -> None:
    auto = scenario({"device": "h100-sxm"})
    fused = scenario({"device": "h100-sxm"}, model={**SMALL["model"], "attention_backend": "fused"})
    unfused = scenario({"device": "h100-sxm"},
                       model={**SMALL["model"], "attention_backend": "unfused"})
    times = [simulate_iteration_times(s, True) for s in (auto, fused, unfused)]
    assert times[0] == times[1] != times[2]


@pytest.mark.parametrize("precision, reduced_in_fp32, grad_bytes", [
    ("bf16", True, 4), ("fp16", False, 2), ("fp32", False, 4)])
def test_gradients_are_reduced_in_fp32_under_bf16_unless_told(
        precision: str, reduced_in_fp32: bool, grad_bytes: int) -> None:
    s = scenario(training={"precision": precision})
    assert s.grad_reduce_in_fp32 == reduced_in_fp32
    assert state_bytes(s.training, 1).grads == grad_bytes
    if precision == "bf16":
        told = scenario(training={"precision": "bf16", "grad_reduce_in_fp32": False})
        assert state_bytes(told.training, 1).grads == 2


def test_fp32_gradients_with_fp32_training_are_refused_only_when_written() -> None:
    with pytest.raises(ScenarioError) as err:
        scenario(training={"precision": "fp32", "grad_reduce_in_fp32": True})
    assert err.value.field == "training.grad_reduce_in_fp32"


@pytest.mark.parametrize("gpu, runs_async", [
    ({"device": "h100-sxm"}, True), ({"device": "a100-80gb", "software": "megatron-lm-2021"},
                                     False),
    ({"device": "a100-80gb", "software": "megatron-lm-2022"}, False), (None, False)])
def test_the_tp_backward_reduces_under_its_gemm_where_megatron_core_runs_on_a_gpu(
        gpu: Any, runs_async: bool) -> None:
    assert scenario(gpu).async_tp_backward == runs_async


def test_an_unknown_software_generation_is_refused_naming_the_field() -> None:
    with pytest.raises(ScenarioError) as err:
        scenario({"device": "h100-sxm", "software": "megatron-core-9"})
    assert err.value.field == "cluster.gpu.software"


def test_unset_keys_are_those_the_file_does_not_write() -> None:
    data = {"model": {"attention_backend": "fused", "ffn_hidden": 128},
            "training": {"grad_reduce_in_fp32": False}}
    unset = unset_keys(data)
    assert not {"model.attention_backend", "model.ffn_hidden_size",
                "training.grad_reduce_in_fp32"} & unset
    assert unset == {d.key for d in DEFAULTS} - {"model.attention_backend",
                                                 "model.ffn_hidden_size",
                                                 "training.grad_reduce_in_fp32"}


def test_predict_lists_the_megatron_defaults_a_scenario_left_unset(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps({**SMALL, "model": {**SMALL["model"], "attention_backend": "flash"},
                                "cluster": {"gpu": {"device": "h100-sxm"}}}))
    out = run_cli("predict", str(path), "--quiet").stdout
    listed = out.split("Megatron defaults used")[1]
    assert "training.grad_reduce_in_fp32: true (precision bf16)" in listed
    assert "parallel.async_tp_backward: true" in listed
    assert "model.attention_backend" not in listed  # the scenario wrote it
    as_json = json.loads(run_cli("predict", str(path), "--quiet", "--json").stdout)
    assert len(as_json["defaults_used"]) == len(DEFAULTS) - 1


def test_the_readme_17b_row_without_an_attention_key_is_within_10_percent() -> None:
    """Megatron-core's 1.7B H100 run, transcribed without model.attention_backend:
    auto is Transformer Engine's fused attention, as the run used."""
    (row,) = [r for r in published_runs(ROOT) if r.source.endswith("H100, 1.7B")]
    assert row.scenario.model.attention_backend is None
    predicted = steady_state_s(simulate_iteration_times(row.scenario, replica=True))
    assert predicted == pytest.approx(row.iteration_s, rel=0.10)
