"""Named devices in ``cluster.gpu``: spec-sheet values, overrides, errors."""
from __future__ import annotations

import json
from typing import Any

import pytest

from megatronapp.scenario.config import ScenarioError, apply_overrides, parse_scenario
from megatronapp.scenario.devices import DEVICES
from sim import simulate_iteration_times

from .support import run_cli

SMALL: dict[str, Any] = {
    "parallel": {"tp": 2, "pp": 2, "dp": 2, "microbatches": 4},
    "model": {"layers": 4, "hidden": 1024, "heads": 8, "seq_len": 512, "vocab": 4096},
}


def on(gpu: Any, **links: Any) -> dict[str, Any]:
    return {**SMALL, "cluster": {"gpu": gpu, **({"links": links} if links else {})}}


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_a_named_device_sets_its_profile(name: str) -> None:
    profile = DEVICES[name]
    s = parse_scenario(on(name))
    for key, value in {**profile.gpu, **profile.fitted}.items():
        assert getattr(s.cluster.gpu, key) == value
    for key, value in profile.links.items():
        assert getattr(s.cluster.links, key) == value


def test_the_scenarios_own_keys_win_over_the_profile() -> None:
    s = parse_scenario(on({"device": "h100-sxm", "memory_gb": 40, "efficiency": 0.3},
                          inter_node_gbps=100))
    assert (s.cluster.gpu.memory_gb, s.cluster.gpu.efficiency) == (40, 0.3)
    assert s.cluster.gpu.tflops == DEVICES["h100-sxm"].gpu["tflops"]
    assert s.cluster.links.inter_node_gbps == 100
    assert s.cluster.links.intra_node_gbps == DEVICES["h100-sxm"].links["intra_node_gbps"]


def test_a_named_device_equals_its_values_written_out() -> None:
    profile = DEVICES["a100-80gb"]
    written = on({**profile.gpu, **profile.fitted}, **profile.links)
    assert simulate_iteration_times(parse_scenario(on("a100-80gb")), True) == \
        simulate_iteration_times(parse_scenario(written), True)


def test_the_faster_device_predicts_a_shorter_iteration() -> None:
    # the same constants, the pipeline exchange's too (fitted per software generation)
    same = {"efficiency": 0.5, "elementwise_traffic": 1.0, "p2p_op_us": None}
    a100, h100 = (simulate_iteration_times(parse_scenario(on({"device": d, **same})), True)[0]
                  for d in ("a100-80gb", "h100-sxm"))
    assert h100 < a100


@pytest.mark.parametrize("gpu", ["h100-pcie", {"device": "a100"}, {"device": 7}])
def test_an_unknown_device_is_refused_naming_the_field(gpu: Any) -> None:
    with pytest.raises(ScenarioError) as err:
        parse_scenario(on(gpu))
    assert err.value.field == "cluster.gpu.device"


def test_the_cli_refuses_an_unknown_device_in_one_line(tmp_path: Any) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("cluster: {gpu: h100-pcie}\n")
    result = run_cli("predict", str(path))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "cluster.gpu.device" in result.stderr


def test_a_key_set_beside_a_device_named_in_short_form_wins_over_the_profile() -> None:
    """``cluster.gpu: h100-sxm`` plus ``--set cluster.gpu.tflops=…`` sets the key
    beside the device, as the mapping form does."""
    short = apply_overrides(on("h100-sxm"), ["cluster.gpu.tflops=900"])
    mapping = apply_overrides(on({"device": "h100-sxm"}), ["cluster.gpu.tflops=900"])
    assert parse_scenario(short) == parse_scenario(mapping)
    assert parse_scenario(short).cluster.gpu.tflops == 900
    assert parse_scenario(short).cluster.gpu.memory_gb == DEVICES["h100-sxm"].gpu["memory_gb"]


def test_the_cli_sets_a_key_beside_a_device_named_in_short_form(tmp_path: Any) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("parallel: {microbatches: 2}\ncluster: {gpu: h100-sxm}\n")
    result = run_cli("predict", str(path), "--set", "cluster.gpu.tflops=500", "--json")
    assert result.returncode == 0, result.stderr
    prediction = json.loads(result.stdout)
    assert prediction["hardware_tflops_per_gpu"] / prediction["mfu"] == pytest.approx(500)
