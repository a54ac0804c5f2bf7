"""``megatronapp run`` of a scenario with an ``fbd`` section: a decoupled run
directory on the simulator and on torch, faults acting on physical devices."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatronapp.cli import main
from megatronapp.scenario.config import load_scenario
from megatronapp.fbd.hetero import steady_iteration_s
from megatronapp.scan.ingest.load import read_events
from megatronapp.scan.ingest.load import load_trace
from sim import simulate as run_scenario
from sim.fbd import compare_plans, run_fbd

SCENARIO = "scenarios/fbd_hetero.yaml"
TWO_ITERATIONS = ["--set", "iterations=2"]


def run_cli(out: Path, *extra: str) -> int:
    return main(["run", SCENARIO, "--out", str(out), "--quiet", *TWO_ITERATIONS, *extra])


@pytest.fixture(scope="module")
def sim_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fbd") / "hetero"
    assert run_cli(out, "--set", "faults=[{kind: clock_skew, rank: 5, offset_us: 1500}]") == 0
    return out


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_sim_run_dir_describes_every_device(sim_dir: Path):
    summary = summary_of(sim_dir)
    fbd = summary["fbd"]
    assert summary["backend"] == "sim" and summary["world_size"] == 8 == len(fbd["devices"])
    assert [d["role"] for d in fbd["devices"]] == ["forward"] * 4 + ["backward"] * 4
    assert [d["class"] for d in fbd["devices"]] == ["slow"] * 4 + ["fast"] * 4
    assert fbd["stages"] == "analytic" and "dpp" not in summary
    assert len(summary["iteration_times_s"]) == 2 and 0 < summary["bubble_fraction"] < 1
    assert summary["scenario"]["fbd"]["forward_class"] == "slow"
    for d in fbd["devices"]:
        assert d["peak_memory_bytes"] > 0 and d["fits"]
    # per-device useful FLOPs add up to the model's forward + backward
    mean = sum(d["useful_tflops"] for d in fbd["devices"]) / len(fbd["devices"])
    assert mean == pytest.approx(fbd["useful_tflops_per_device"], rel=1e-9)


def test_trace_has_a_named_process_per_worker(sim_dir: Path):
    trace = json.loads((sim_dir / "trace.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert len(names) == 8 == len(load_trace(sim_dir).events)
    assert names[1].startswith("forward worker F1 · virtual rank 1") and "device 1 [slow]" in names[1]
    assert names[4].startswith("backward worker B0 · virtual rank 0") and "device 4 [fast]" in names[4]
    events = read_events(sim_dir / "trace.json")
    assert {e.name for e in events[4]} >= {"recompute_forward", "backward", "optimizer"}


def test_clock_skew_shifts_the_raw_file_of_the_skewed_device_only(sim_dir: Path):
    truth = json.loads((sim_dir / "ground_truth.json").read_text())
    assert truth["skewed_devices"] == [5] and truth["skewed_ranks"] == [5]
    aligned = read_events(sim_dir / "trace.json")
    raw = load_trace(sim_dir, raw_clocks=True).events
    for pid, shift in ((5, 1500e-6), (6, 0.0)):
        local = raw[pid]
        assert local[0].start_s - aligned[pid][0].start_s == pytest.approx(shift, abs=1e-9)


def test_iteration_time_equals_the_fbd_plan_of_fbd_compare(sim_dir: Path):
    s = load_scenario(SCENARIO, ["iterations=2", "faults=[{kind: clock_skew, rank: 5}]"])
    plan = next(p for p in compare_plans(s) if p.name == "FBD F->slow B->fast")
    fbd = summary_of(sim_dir)["fbd"]
    assert fbd["steady_iteration_s"] == pytest.approx(plan.iteration_s, rel=1e-12)
    assert fbd["useful_tflops_per_device"] == pytest.approx(plan.flops_per_device / 1e12, rel=1e-9)


def steady_s(*faults: str) -> float:
    s = load_scenario(SCENARIO, ["iterations=2", f"faults=[{', '.join(faults)}]"])
    return run_scenario(s).fbd.steady_iteration_s


def test_a_throttled_forward_device_lengthens_the_iteration():
    healthy = steady_s()
    assert steady_s("{kind: throttle, rank: 1, factor: 2}") > 1.2 * healthy
    # a slower backward device lengthens it too, an idle one does not
    assert steady_s("{kind: throttle, rank: 6, factor: 2}") > healthy
    assert steady_s("{kind: throttle, rank: 3, factor: 2}") == pytest.approx(healthy)


def test_a_slow_link_between_forward_devices_lengthens_the_iteration():
    assert steady_s("{kind: slow_link, ranks: [1, 2], factor: 50}") > steady_s()


@pytest.mark.parametrize("fault, field", [
    ("{kind: throttle, rank: 8, factor: 2}", "faults[0].rank"),
    ("{kind: slow_link, ranks: [0, 9], factor: 2}", "faults[0].ranks"),
    ("{kind: clock_skew, rank: -1}", "faults[0].rank"),
])
def test_fault_ranks_beyond_the_devices_exit_2_naming_the_field(tmp_path, capsys, fault, field):
    out = tmp_path / "bad"
    assert run_cli(out, "--set", f"faults=[{fault}]") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0] and "Traceback" not in err[0]
    assert not out.exists() and not list(tmp_path.iterdir())


def test_fault_ranks_count_devices_not_virtual_ranks():
    # tp 2 with forward tp 1: 2 forward + 4 backward devices for 4 virtual ranks
    shape = ["parallel.tp=2", "parallel.pp=2", "fbd.forward_tp=1", "model.layers=4",
             "cluster.device_classes.0.count=8", "cluster.device_classes.1.count=8"]
    s = load_scenario(SCENARIO, [*shape, "faults=[{kind: throttle, rank: 5, factor: 2}]"])
    fbd = run_scenario(s).fbd
    assert fbd is not None and fbd.world_size == 6
    with pytest.raises(Exception, match=r"faults\[0\]\.rank: rank 6 out of range 0\.\.5"):
        load_scenario(SCENARIO, [*shape, "faults=[{kind: throttle, rank: 6, factor: 2}]"])


def test_a_scenario_without_fbd_trains_co_located():
    s = load_scenario(SCENARIO, ["iterations=1", "fbd=null"])
    result = run_scenario(s)
    assert result.fbd is None and result.topo.world_size == 4


TINY = ["parallel.pp=2", "model.layers=4", "model.hidden=16", "model.heads=2", "model.seq_len=4",
        "parallel.microbatches=3"]


@pytest.mark.slow
def test_torch_backend_writes_a_decoupled_run_dir(tmp_path, capsys):
    out = tmp_path / "torch"
    sets = [x for kv in TINY for x in ("--set", kv)]
    throttle = "faults=[{kind: throttle, rank: 3, factor: 2}, {kind: clock_skew, rank: 1, offset_us: 900}]"
    assert main(["run", SCENARIO, "--backend", "torch", "--out", str(out), "--quiet", *sets,
                 "--set", throttle, *TWO_ITERATIONS]) == 0
    assert "MegaFBD on 4 devices" in capsys.readouterr().out
    summary = summary_of(out)
    fbd = summary["fbd"]
    assert summary["backend"] == "torch" and summary["world_size"] == 4
    assert fbd["stages"] == "gpt" and fbd["coordinator_rounds"] > 0
    assert [d["role"] for d in fbd["devices"]] == ["forward"] * 2 + ["backward"] * 2
    assert all(d["peak_memory_bytes"] > 0 for d in fbd["devices"])
    assert len(summary["loss_per_iteration"]) == 2 and len(summary["iteration_times_s"]) == 2
    events = read_events(out / "trace.json")
    assert sorted(events) == [0, 1, 2, 3]
    assert {e.name for e in events[3]} >= {"recompute_forward", "backward", "optimizer",
                                           "send_backward", "recv_input"}
    assert any(e.name == "send_forward" and e.args["peer"] == 1 for e in events[0])
    truth = json.loads((out / "ground_truth.json").read_text())
    assert truth["skewed_ranks"] == [1] and truth["clocks"]["1"]["offset_us"] == 900
    assert sorted(load_trace(out).events) == [0, 1, 2, 3]


def test_decoupled_runs_refuse_model_chunks_naming_the_field(tmp_path, capsys):
    assert main(["run", SCENARIO, "--backend", "torch", "--out", str(tmp_path / "x"),
                 "--set", "parallel.vpp=2", "--set", "schedule=interleaved"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.vpp" in err[0] and not (tmp_path / "x").exists()


def test_a_placement_that_does_not_fit_is_refused_before_running(tmp_path, capsys):
    """The largest device need is known before the run (model states, one
    recomputed microbatch, an iteration's stage inputs waiting)."""
    assert run_cli(tmp_path / "x", "--set", "model.layers=10000000") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cluster.device_classes" in err[0] and "device 0" in err[0]
    assert "GB" in err[0] and not list(tmp_path.iterdir())


def test_a_long_simulated_wait_costs_rounds_per_change_not_per_nap():
    """A backward of 10^6 s with compute jitter: control threads do not spin
    through the wait (one round per nap would be ~10^9 rounds)."""
    s = load_scenario(SCENARIO, ["iterations=2", "costs.backward_s=1e6",
                                 "cluster.jitter.compute_sigma=0.1"])
    run = run_fbd(s)
    assert steady_iteration_s(run.events) > 1e6
    assert run.simulated_rounds < 1000 < run.rounds  # skipped rounds are counted, not run


@pytest.mark.parametrize("jitter", ["0.0", "0.2"])
def test_skipping_idle_rounds_changes_no_time(jitter):
    """Skipped rounds are the ones that would have run nothing: the timeline
    and the round count equal a simulation that runs every round."""
    s = load_scenario(SCENARIO, ["iterations=2", "costs.backward_s=0.2",
                                 f"cluster.jitter.compute_sigma={jitter}"])
    fast, slow = run_fbd(s), run_fbd(s, skip_idle_rounds=False)
    assert fast.simulated_rounds < slow.simulated_rounds == slow.rounds == fast.rounds
    for worker, events in slow.events.items():
        assert [e.name for e in fast.events[worker]] == [e.name for e in events]
        times = [t for e in events for t in (e.start_s, e.end_s)]
        assert [t for e in fast.events[worker] for t in (e.start_s, e.end_s)] == pytest.approx(
            times, rel=1e-9)
