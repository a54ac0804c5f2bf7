"""``megatronapp calibrate`` from a torch.profiler (Kineto) trace: compute
ranges named only forward/backward/optimizer are placed by the scenario's
programs, then fitted like a run directory's events."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from megatronapp.scenario.config import load_scenario
from megatronapp.fidelity.fit import with_settings
from megatronapp.trace.kinds import event_kind
from sim import run_sim

from .support import ROOT, run_cli
from .support import CALIBRATION_TRUTH

CPU_TINY = ROOT / "scenarios" / "fidelity" / "cpu_tiny.yaml"
COMPUTE_FITS = ("cluster.gpu.efficiency", "cluster.gpu.gemm_overhead_us",
                "cluster.gpu.module_overhead_us", "cluster.gpu.backward_ratio",
                "cluster.gpu.hbm_tbps")


def _profile_of(events: dict, directory: Path,
                edit: Callable[[int, list[dict]], None] = lambda _r, _e: None) -> Path:
    """One Kineto file per rank holding what a profiled job's CPU trace holds
    of its compute: ``user_annotation`` ranges with a name and no arguments."""
    directory.mkdir()
    for rank, evs in events.items():
        ranges = [{"ph": "X", "cat": "user_annotation", "name": e.name, "pid": 100 + rank,
                   "tid": 100 + rank, "ts": e.start_s * 1e6, "dur": e.dur_s * 1e6}
                  for e in evs if event_kind(e.name, e.args) == "compute"]
        edit(rank, ranges)
        data: dict[str, Any] = {"schemaVersion": 1, "baseTimeNanoseconds": 1_790_000_000 * 10**9,
                                "traceEvents": ranges,
                                "distributedInfo": {"rank": rank, "world_size": len(events)}}
        (directory / f"host.{rank}.pt.trace.json").write_text(json.dumps(data))
    return directory


def _simulated_events() -> dict:
    return run_sim(with_settings(load_scenario(CPU_TINY), CALIBRATION_TRUTH)).events


def _calibrate(measured: Path, out: Path) -> Any:
    return run_cli("calibrate", str(measured), "--scenario", str(CPU_TINY), "--out", str(out),
                   "--json")


def test_a_profile_of_a_simulated_run_gives_back_its_compute_constants(tmp_path: Path) -> None:
    profile = _profile_of(_simulated_events(), tmp_path / "profile")
    proc = _calibrate(profile, tmp_path / "calibrated.yaml")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    for key in COMPUTE_FITS:  # placed by the programs: first, middle and last chunks apart
        assert report["settings"][key] == pytest.approx(CALIBRATION_TRUTH[key], rel=1e-3), key
    assert set(report["evidence"]["forward_s_by_chunk_kind"]) == {"first", "middle", "last"}
    assert "cluster.gpu.op_overhead_us" not in report["settings"]
    assert report["evidence"]["kept_from_scenario"] == ["cluster.gpu.op_overhead_us"]
    assert load_scenario(tmp_path / "calibrated.yaml").cluster.gpu.efficiency == pytest.approx(
        CALIBRATION_TRUTH["cluster.gpu.efficiency"], rel=1e-3)


def _drop_last_range(rank: int, ranges: list[dict]) -> None:
    if rank == 1:
        ranges.pop()


def _swap_first_two_names(rank: int, ranges: list[dict]) -> None:
    if rank == 0:
        first = next(i for i, r in enumerate(ranges) if r["name"] == "backward")
        ranges[0]["name"], ranges[first]["name"] = ranges[first]["name"], ranges[0]["name"]


@pytest.mark.parametrize("edit, fragment", [
    (_drop_last_range, "rank 1 has"),
    (_swap_first_two_names, "rank 0's compute range 0 is 'backward'"),
])
def test_a_profile_that_does_not_follow_the_schedule_is_refused(tmp_path: Path, edit, fragment):
    profile = _profile_of(_simulated_events(), tmp_path / "profile", edit)
    out = tmp_path / "calibrated.yaml"
    proc = _calibrate(profile, out)
    assert proc.returncode == 2 and not proc.stdout and not out.exists()
    assert len(proc.stderr.strip().splitlines()) == 1 and fragment in proc.stderr
    assert "per iteration" in proc.stderr or "does not follow" in proc.stderr


def test_a_profile_of_other_ranks_than_the_scenario_is_refused(tmp_path: Path) -> None:
    events = _simulated_events()
    profile = _profile_of({0: events[0]}, tmp_path / "profile")
    proc = _calibrate(profile, tmp_path / "calibrated.yaml")
    assert proc.returncode == 2 and "the trace has ranks [0], the scenario 2 ranks" in proc.stderr


def test_messages_of_unknown_size_fit_no_bandwidth() -> None:
    """A profile may record a transfer without its size: such messages are not
    used for bandwidth (a zero would make an invalid calibrated scenario)."""
    from megatronapp.fidelity.calibrate import Calibration, fit_links
    from megatronapp.trace.events import Event

    def pair(nbytes: int, t: float) -> dict[int, list[Event]]:
        common = {"tag": "f0", "iteration": 0, "kind": "p2p", "bytes": nbytes}
        return {0: [Event("send", t, 1e-3, {**common, "role": "send", "peer": 1})],
                1: [Event("recv", t - 1e-4, 2e-3, {**common, "role": "recv", "peer": 0})]}

    s = load_scenario(CPU_TINY)
    sized, unsized = Calibration(), Calibration()
    fit_links(s, pair(1 << 20, 1.0), sized)
    fit_links(s, pair(0, 1.0), unsized)
    assert sized.settings["cluster.links.intra_node_gbps"] > 0
    assert "cluster.links.intra_node_gbps" not in unsized.settings
