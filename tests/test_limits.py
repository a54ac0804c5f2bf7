"""Sizes checked before any work: one line with the estimate and the limit."""
from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from backends.registry import get_backend
from sim import simulate as run_scenario
from megatronapp.cli import main
from megatronapp.scenario.config import load_scenario, parse_scenario
from megatronapp.host.limits import (COSTS, Limits, available_memory, check, estimate_run,
                                estimate_topology)

from .support import ROOT, peak_memory_of

BASE = ("name: tiny\nparallel: {pp: 2, microbatches: 2}\n"
        "model: {layers: 2, hidden: 64, heads: 2, seq_len: 64, vocab: 128}\n")


def _run(capsys, tmp_path: Path, command: list[str], *argv: str) -> tuple[int, list[str]]:
    path = tmp_path / "s.yaml"
    path.write_text(BASE)
    code = main([*command, str(path), *argv])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("sets", [
    ["parallel.microbatches=1000000000"],
    ["iterations=1000000"],
    ["parallel.pp=100000", "model.layers=100000"],
    ["parallel.dp=1000000"],
    ["parallel.tp=65536", "model.heads=65536", "model.hidden=65536"],
])
@pytest.mark.parametrize("command", [["run"], ["dpp", "compare"]])
def test_huge_sizes_are_refused_before_any_work(capsys, tmp_path, monkeypatch, sets, command):
    monkeypatch.chdir(tmp_path)
    code, err = _run(capsys, tmp_path, command, "--max-seconds", "600",  # any machine
                     *[a for s in sets for a in ("--set", s)])
    assert code == 2 and len(err) == 1 and err[0].startswith("megatronapp: limits:"), err
    assert "--no-limits" in err[0] and "trace events" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"]


def test_topology_of_a_quadrillion_ranks_is_refused(capsys):
    code = main(["topology", "--tp", "100000", "--pp", "100000", "--dp", "100000"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "1,000,000,000,000,000 ranks" in err[0]


def test_the_time_limit_is_explicit_and_so_is_skipping_it(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = _run(capsys, tmp_path, ["run"], "--quiet", "--max-seconds", "0.01")
    assert code == 2 and len(err) == 1 and "too long" in err[0] and "0.01 s" in err[0]
    code, err = _run(capsys, tmp_path, ["run"], "--quiet", "--max-seconds", "0.01", "--no-limits")
    assert code == 0, err
    assert (tmp_path / "runs" / "tiny" / "summary.json").is_file()


@pytest.mark.parametrize("option", ["--max-seconds", "--stall-timeout"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_seconds_options_must_be_finite_and_positive(capsys, option, value):
    assert main(["run", "s.yaml", option, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and option in err[0] and "finite" in err[0]


@pytest.mark.parametrize("shape", [
    {"parallel": {"pp": 4, "microbatches": 8}},
    {"parallel": {"tp": 2, "pp": 2, "dp": 2, "microbatches": 4}, "iterations": 2},
    {"schedule": "interleaved", "parallel": {"pp": 2, "vpp": 2, "dp": 2, "microbatches": 4}},
    {"parallel": {"tp": 4, "dp": 3, "microbatches": 3}},
    {"parallel": {"tp": 2, "pp": 2, "dp": 2, "microbatches": 4, "sequence_parallel": True},
     "training": {"recompute": "full"}},
    {"parallel": {"tp": 2, "pp": 2, "dp": 2, "microbatches": 4, "scatter_gather_p2p": True},
     "training": {"distributed_optimizer": True, "overlap_grad_reduce": True,
                  "overlap_param_gather": True, "bucket_params": 1000}, "iterations": 2},
])
def test_the_event_estimate_bounds_what_the_simulator_records(shape):
    data = {"model": {"layers": 8, "hidden": 64, "heads": 4, "seq_len": 64, "vocab": 128},
            **shape}
    s = parse_scenario(data)
    events = sum(len(v) for v in run_scenario(s).events.values())
    estimate = estimate_run(s)
    assert events <= estimate.events <= 2 * events


@pytest.mark.parametrize("sets", [[], ["cluster.jitter.link_sigma=0.2",
                                      "cluster.jitter.compute_sigma=0.1"]])
def test_the_disk_estimate_bounds_what_a_compiled_run_writes(tmp_path, sets):
    path = tmp_path / "s.yaml"
    path.write_text("parallel: {tp: 2, pp: 4, dp: 8, microbatches: 8}\n"
                    "model: {layers: 8, hidden: 64, heads: 4, seq_len: 64, vocab: 128}\n")
    out = tmp_path / "run"
    assert main(["run", str(path), "--out", str(out), "--quiet",
                 *[a for s in sets for a in ("--set", s)]]) == 0
    written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    estimate = estimate_run(load_scenario(path, sets))
    assert (out / "trace.parquet").is_file() and written <= estimate.disk_bytes


def test_more_faults_and_ranks_cost_more():
    base = parse_scenario({"parallel": {"pp": 2, "dp": 2}, "model": {"layers": 2}})
    throttles = [{"kind": "throttle", "rank": 0, "factor": 1.0, "start_s": i * 1e-3,
                  "end_s": i * 1e-3 + 1e-3} for i in range(1000)]
    faulty = parse_scenario({"parallel": {"pp": 2, "dp": 2}, "model": {"layers": 2},
                             "faults": throttles})
    wide = parse_scenario({"parallel": {"pp": 2, "dp": 64}, "model": {"layers": 2}})
    assert estimate_run(faulty).seconds > estimate_run(base).seconds + 1000 * COSTS.seconds_per_fault
    assert estimate_run(wide).group_entries > 64 * estimate_run(base).group_entries
    roomy = Limits(memory_bytes=1e12, disk_bytes=None, max_seconds=1e9, max_torch_ranks=64)
    check(estimate_run(wide), roomy)
    with pytest.raises(Exception, match="processes on the torch backend"):
        check(estimate_run(wide), roomy, backend="torch", estimated=False)
    assert estimate_topology(10**6).memory_bytes > estimate_topology(10**3).memory_bytes


def _cap_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def test_available_memory_respects_an_address_space_cap():
    code = "from megatronapp.host.limits import available_memory; print(available_memory())"
    capped = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, preexec_fn=_cap_address_space, timeout=120)
    assert capped.returncode == 0, capped.stderr
    assert 0 < float(capped.stdout) < 3 << 30 and available_memory() > 0


SYMMETRIC = ("parallel: {tp: 2, pp: 4, dp: 8, microbatches: 8}\n"
             "model: {layers: 8, hidden: 64, heads: 4, seq_len: 64, vocab: 128}\n")


@pytest.mark.parametrize("sets", [
    [],  # every pipeline alike: one simulated
    ["faults=[{kind: throttle, rank: 9, factor: 1.5}, {kind: slow_link, ranks: [1, 17], "
     "factor: 2.0}]"],
    ["cluster.jitter.link_sigma=0.2"],  # nothing alike: every pipeline simulated
])
def test_the_run_estimate_counts_what_the_compiled_engine_simulates_and_records(tmp_path, sets):
    path = tmp_path / "s.yaml"
    path.write_text(SYMMETRIC)
    s = load_scenario(path, sets)
    estimate = estimate_run(s, get_backend("sim").size)
    source = run_scenario(s).source
    simulated, _weights = source.compact()
    assert (estimate.events, estimate.simulated_events) == (source.events, len(simulated))
    out = tmp_path / "run"
    peak = peak_memory_of(["run", str(path), "--out", str(out), "--quiet",
                         *[a for x in sets for a in ("--set", x)]])
    assert estimate.memory_bytes / 3 <= peak <= 3 * estimate.memory_bytes
