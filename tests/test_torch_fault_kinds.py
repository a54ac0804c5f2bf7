"""The fault kinds on the torch backend, for real: a host stall is slept before
the forward, an intermittent throttle only in the iterations it hits, a
flapping link delays the transfers that meet a drop, a crash kills its rank's
process and the run records where it stopped. Two small runs (gloo, 2 and 4
ranks); every test here spawns processes."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from backends.torch.interpreter import INJECTED
from backends.torch.launch import spawn_run

from .support import ROOT, TINY_MODEL, run_cli, torch_scenario

pytestmark = pytest.mark.slow

STALL_S = 0.2


@pytest.fixture(scope="module")
def faulted() -> Any:
    """pp 2: rank 0 stalled before the forward of odd iterations, rank 1 4x slow
    in them, their link down 50 ms every 0.3 s (retry 20 ms)."""
    s = torch_scenario({"pp": 2, "microbatches": 4}, iterations=4, costs={"p2p_s": 0.01},
                       faults=[{"kind": "host_stall", "rank": 0, "seconds": STALL_S,
                                "every_k_iterations": 2},
                               {"kind": "throttle", "rank": 1, "factor": 4.0,
                                "every_k_iterations": 2},
                               {"kind": "link_flap", "ranks": [0, 1], "down_ms": 50,
                                "every_s": 0.3, "retry_ms": 20}])
    run, _ = spawn_run(s)
    return s, run


def test_a_host_stall_is_slept_before_the_iterations_first_forward(faulted: Any) -> None:
    """The stall lies between the rank's ops, before the forward, and inside
    the iteration's range (``ProfilerStep#N``, as torch.profiler marks it)."""
    _s, run = faulted
    events = sorted((e for e in run.events[0] if e.args["kind"] != "other"),
                    key=lambda e: e.start_s)
    began = {e.args["iteration"]: e.start_s for e in run.events[0] if e.args["kind"] == "other"}
    for it in range(4):
        first = next(i for i, e in enumerate(events) if e.name == "forward"
                     and e.args["iteration"] == it)
        if it % 2 == 1:
            assert events[first].start_s - began[it] >= STALL_S
        if it == 0:
            continue
        gap = events[first].start_s - max(e.start_s + e.dur_s for e in events[:first])
        if it % 2 == 1:  # stalled: nothing of the rank runs meanwhile
            assert gap >= STALL_S
        assert INJECTED not in events[first].args  # the stall is outside the op


def test_an_intermittent_throttle_sleeps_only_in_the_iterations_it_hits(faulted: Any) -> None:
    _s, run = faulted
    for e in run.events[1]:
        if e.args["kind"] == "compute" and e.name in ("forward", "backward"):
            slept = e.args[INJECTED]
            assert (slept > 0) == (e.args["iteration"] % 2 == 1), e


def test_a_flapping_link_delays_what_meets_a_drop_as_the_link_model_says(faulted: Any) -> None:
    """A send waits out the rest of the drop it meets and the retry (at most
    down + retry), or nothing; only sends posted in or just before a drop wait."""
    _s, run = faulted
    delays = []
    for rank in (0, 1):
        for e in run.events[rank]:
            if e.args["kind"] == "p2p" and e.args["role"] == "send":
                late = e.args[INJECTED]
                delays.append(late)
                if late > 0:
                    assert 0.02 - 1e-9 <= late <= 0.05 + 0.02 + 1e-9
                    into = e.start_s % 0.3  # drops at 0, 0.3, 0.6 ... s
                    assert into <= 0.05 + 0.01 or into >= 0.3 - 0.01 - 0.01, e
    assert max(delays) > 0 and min(delays) == 0.0


def test_a_stall_before_the_first_forward_is_named_in_every_iteration(tmp_path: Path) -> None:
    """A stall before every iteration's forward, the first one's included: the
    rank's range of iteration 0 holds it, so MegaScan reads the rank's host
    time in every iteration and names it (without the range the first stall
    would come before anything the rank recorded)."""
    scenario = tmp_path / "stall.yaml"
    scenario.write_text(yaml.safe_dump({
        "seed": 3, "iterations": 4, "schedule": "1f1b",
        "parallel": {"pp": 2, "dp": 2, "microbatches": 4}, "model": {"layers": 4, **TINY_MODEL},
        "costs": {"p2p_s": 0.002},
        "faults": [{"kind": "host_stall", "rank": 1, "seconds": STALL_S}]}))
    run = run_cli("run", str(scenario), "--backend", "torch", "--out", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr
    verdict = run_cli("detect", str(tmp_path / "run"), "--json")
    assert verdict.returncode == 0, verdict.stderr
    first = json.loads(verdict.stdout)["root_causes"][0]
    assert (first["kind"], first["rank"]) == ("host", 1)
    assert first["evidence"]["iterations_hit"] == "all"  # not 1-3 of 4: intermittent


def test_a_crash_kills_its_rank_and_the_run_records_the_stop(tmp_path: Path) -> None:
    """A crash 3 s in: the job stops there, NCCL-timeout-like; what the ranks
    recorded is written, with the stop in the summary; no process is left."""
    scenario = tmp_path / "crash.yaml"
    scenario.write_text(yaml.safe_dump({
        "seed": 5, "iterations": 400, "schedule": "1f1b", "parallel": {"pp": 2, "microbatches": 2},
        "model": {"layers": 2, **TINY_MODEL}, "faults": [{"kind": "crash", "rank": 1, "at_s": 3.0}]}))
    proc = run_cli("run", str(scenario), "--backend", "torch", "--out", str(tmp_path / "run"),
                   "--json", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    stopped = json.loads(proc.stdout)["stopped"]
    assert stopped["by"] == "crash" and stopped["rank"] == 1 and stopped["at_s"] == 3.0
    assert 0 < stopped["iterations_completed"] < 400
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped"] == stopped
