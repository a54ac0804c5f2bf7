"""Memory accounting, the static-schedule memory check, and window metrics."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatronapp.dpp.memory import MemoryExceeded, order_peak_slots
from megatronapp.dpp.windows import send_windows, window_metrics
from megatronapp.parallel.schedules import PipeShape, static_order
from sim import run_sim
from tests.support import ROOT, fixed_cost_scenario, run_cli


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 2)])
def test_1f1b_holds_at_most_pp_minus_rank_activations(pp: int, m: int) -> None:
    shape = PipeShape(pp, 1, m)
    assert [order_peak_slots(static_order("1f1b", r, shape)) for r in range(pp)] == \
        [min(pp - r, m) for r in range(pp)]


def test_breadth_first_needs_more_memory_than_depth_first() -> None:
    shape = PipeShape(4, 2, 8)
    # Warm-up forwards + 1: (P - r - 1) * 2 + (V - 1) * group + 1.
    assert order_peak_slots(static_order("dfc", 0, shape)) == 6 + 4 + 1
    assert order_peak_slots(static_order("bfc", 0, shape)) == 6 + 8 + 1


def test_cli_refuses_a_static_schedule_that_does_not_fit(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli("run", "scenarios/dpp_healthy.yaml", "--set", "schedule=bfc", "--out", str(out))
    assert proc.returncode == 2 and not out.exists()
    (line,) = proc.stderr.strip().splitlines()
    assert "cluster.gpu.memory_gb" in line and "rank 0" in line and "GB" in line


def test_static_check_names_the_rank_and_its_peak() -> None:
    s = fixed_cost_scenario(schedule="gpipe", cluster={"gpu": {"memory_gb": 1.0}},
                            model={"layers": 48, "hidden": 2048, "heads": 16, "seq_len": 2048})
    with pytest.raises(MemoryExceeded) as err:
        run_sim(s)
    assert err.value.rank == 0 and err.value.peak_bytes > 1e9


def test_windows_match_a_hand_computed_1f1b_timeline() -> None:
    # pp 2, 2 microbatches, forward 1 s, backward 2 s, free communication.
    # rank 0: F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9]; rank 1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7].
    s = fixed_cost_scenario(parallel={"pp": 2, "microbatches": 2})
    events = run_sim(s).events
    windows = sorted((w.phase, w.microbatch, w.window_s) for w in send_windows(events))
    # Only rank 0's second forward output waits: sent at 2, needed at 4.
    assert windows == [("backward", 0, 0.0), ("backward", 1, 0.0),
                       ("forward", 0, 0.0), ("forward", 1, 2.0)]
    m = window_metrics(events)
    # All-reduce windows: rank 0's last backward ends at the step (9), rank 1's at 7.
    assert m.allreduce_window_s == pytest.approx((0.0 + 2.0) / 2)
    assert m.compute_ratio == pytest.approx(6 / 9)
    assert m.p2p_send_window_s == pytest.approx(0.5)


@pytest.mark.slow
def test_summary_json_carries_windows_and_peak_memory(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli("run", "scenarios/dpp_healthy.yaml", "--set", "iterations=1", "--out", str(out),
                   "--quiet")
    assert proc.returncode == 0, proc.stderr
    dpp = json.loads((out / "summary.json").read_text())["dpp"]
    assert 0 < dpp["peak_memory_bytes"] <= dpp["memory_capacity_bytes"]
    assert dpp["p2p_send_window_s"] > 0 and dpp["allreduce_window_s"] > 0
    plot = run_cli("plot", str(out))
    assert plot.returncode == 0 and (out / "dpp_windows.png").stat().st_size > 0


def test_dpp_windows_prints_durations_in_ms_like_dpp_compare(tmp_path: Path) -> None:
    out = tmp_path / "res"
    assert run_cli("run", str(ROOT / "scenarios" / "throttle.yaml"), "--out",
                   str(out)).returncode == 0
    printed = run_cli("dpp", "windows", str(out)).stdout.split("\n")
    keys = {line.split()[0] for line in printed if line.strip()}
    assert {"p2p_send_window_ms", "allreduce_window_ms"} <= keys
    assert not any(key.endswith("_s") for key in keys)
