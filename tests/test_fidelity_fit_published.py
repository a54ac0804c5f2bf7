"""``megatronapp fidelity fit``: the device profiles' fitted constants are
written by a command, per software generation, into the package data file,
whose header and other generations stay as they were."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatronapp.fidelity.fit_published import (GenerationFit, fitted_on, parse_generation,
                                                write_fits)
from megatronapp.scenario.devices import FITS_FILE, load_fits, with_fits, SPECS

from .support import run_cli


def test_a_fit_replaces_its_generation_and_keeps_the_others_and_the_header(
        tmp_path: Path) -> None:
    path = tmp_path / "device_fits.yaml"
    shutil.copy(FITS_FILE, path)
    before = load_fits(path)
    result = GenerationFit(("h100-sxm", "llama3-2024"), {"kernel_time_factor": 1.234567},
                           ("Llama 3 (Dubey et al. 2024), Table 4, 405B, 16,384 GPUs",),
                           (0.0,), 2)
    write_fits([result], path)
    after = load_fits(path)
    assert after["h100-sxm"]["llama3-2024"] == {
        "constants": {"kernel_time_factor": 1.2346},
        "fitted_on": "Llama 3 (Dubey et al. 2024), Table 4, 405B: 16,384 GPUs"}
    assert after["h100-sxm"]["default"] == before["h100-sxm"]["default"]
    assert {k: v for k, v in after.items() if k != "h100-sxm"} == \
        {k: v for k, v in before.items() if k != "h100-sxm"}
    header = [line for line in FITS_FILE.read_text().splitlines() if line.startswith("#")]
    assert path.read_text().splitlines()[:len(header)] == header
    profiles = with_fits(SPECS, after)  # the profiles read it back
    assert profiles["h100-sxm"].fit_for("llama3-2024").constants["kernel_time_factor"] == 1.2346
    assert profiles["h200"].fits == profiles["h100-sxm"].fits  # the H200 shares the H100's


def test_a_generation_without_rows_of_its_own_takes_the_devices_default() -> None:
    profiles = with_fits(SPECS, load_fits())
    h100 = profiles["h100-sxm"]
    assert h100.fit_for("megatron-core-0.16") == h100.fits[h100.default_software]
    assert profiles["a100-80gb"].fit_for("megatron-lm-2022") is not None


def test_the_rows_of_one_source_are_named_once() -> None:
    sources = ["Megatron-LM README, Megatron-Core r0.8.0 on H100, 1.7B",
               "Megatron-LM README, Megatron-Core r0.8.0 on H100, 16B"]
    assert fitted_on(sources) == "Megatron-LM README, Megatron-Core r0.8.0 on H100: 1.7B, 16B"
    assert fitted_on(["a, b", "c, d"]) == "a, b; c, d"


def test_an_unknown_generation_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError):
        parse_generation("h100-sxm:megatron-core-0.16")  # no rows of its own
    proc = run_cli("fidelity", "fit", "--generation", "h100:x", "--quiet")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "--generation" in line and "h100-sxm:megatron-core-0.8" in line


def test_a_root_without_published_rows_is_refused_in_one_line(tmp_path: Path) -> None:
    proc = run_cli("fidelity", "fit", "--root", str(tmp_path), "--quiet")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "--root" in line


def test_predict_says_when_a_generation_takes_another_generations_constants(
        tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("model: {layers: 4, hidden: 512, heads: 8, seq_len: 512, vocab: 1024}\n"
                    "cluster: {gpu: {device: h100-sxm}}\n")
    out = run_cli("predict", str(path), "--quiet").stdout
    assert ("note: cluster.gpu.software: megatron-core-0.16 has no published rows fitted on "
            "h100-sxm; the constants of megatron-core-0.8 stand in") in out
    path.write_text(path.read_text().replace("{device: h100-sxm}",
                                             "{device: h100-sxm, software: megatron-core-0.8}"))
    assert "stand in" not in run_cli("predict", str(path), "--quiet").stdout
