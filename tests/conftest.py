"""Shared fixtures: scenario builders and a CLI runner."""
from __future__ import annotations

import fcntl
import io
import os
import subprocess
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

from megatronapp.scenario.config import Scenario, parse_scenario

ROOT = Path(__file__).resolve().parents[1]

# No wall-clock bound in any test: hypothesis' per-example deadline and its
# too-slow health check fail examples on a loaded machine, not on wrong code.
settings.register_profile("megatronapp", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("megatronapp")


# Tests marked ``alone`` judge real timing (a profiled job's slow rank): no
# other test may share the cores with them, or the suite's own load becomes
# the slow rank (a busy neighbour on one core made a healthy 4-rank job's
# rank 0 slow at its best). Under xdist the workers share one lock file:
# every other test holds it shared, ``alone`` tests exclusively, from their
# fixtures' set-up to their teardown. A second lock is a turnstile: an
# ``alone`` test holds it while it waits, so a stream of short tests that
# keep the shared lock taken cannot starve it.
MACHINE_LOCK = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    # xdist gives each worker the base directory <shared>/<worker id>
    basetemp = config.option.basetemp
    if os.environ.get("PYTEST_XDIST_WORKER") and basetemp:
        config.stash[MACHINE_LOCK] = Path(basetemp).parent / "machine.lock"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    mode = fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH
    path = item.config.stash.get(MACHINE_LOCK, None)
    if path is None:
        yield
        return
    with open(path.with_suffix(".turnstile"), "a") as turnstile, open(path, "a") as handle:
        fcntl.flock(turnstile, mode)
        fcntl.flock(handle, mode)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def fixed_cost_scenario(**overrides: Any) -> Scenario:
    """Fixed compute costs and zero communication: closed forms hold exactly."""
    data: dict[str, Any] = {
        "schedule": "1f1b",
        "parallel": {"pp": 4, "microbatches": 8},
        "model": {"layers": 48, "hidden": 256, "heads": 4, "seq_len": 256, "vocab": 1024},
        "costs": {"forward_s": 1.0, "backward_s": 2.0, "p2p_s": 0.0, "allreduce_s": 0.0,
                  "optimizer_s": 0.0},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return parse_scenario(data)


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The console entry point's ``main`` run in this process (nothing is
    spawned): its exit status, stdout and stderr. tests/test_entry_point.py
    runs the installed command itself."""
    from megatronapp.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(cwd or ROOT)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["megatronapp", *args], code, out.getvalue(), err.getvalue())
