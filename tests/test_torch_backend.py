"""The torch.distributed backend, for real: spawned gloo ranks with megatron-core stages.

Every test here spawns processes: the whole module is marked slow."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pytest
import torch
import yaml

from backends.torch import launch
from backends.torch.interpreter import INJECTED
from backends.torch.launch import TorchDeadlock, spawn_run
from backends.torch.stages import TrainOptions
from backends.torch.worker import WorkerResult
from megatronapp import cli
from megatronapp.scenario.config import Scenario, parse_scenario
from megatronapp.parallel.ops import Compute, Recv
from megatronapp.program.ranks import NullStages
from megatronapp.scan.ingest.load import load_trace
from megatronapp.trace.events import Event
from sim import injected_faults, run_sim

from .support import (ROOT, SGD, TINY_MODEL, compute_sequence, free_port, full_model,
                      sample_losses, torch_scenario)

pytestmark = pytest.mark.slow


def single_process_reference(s: Scenario, results: Sequence[WorkerResult]):
    """The same global batch through one unsplit megatron GPTModel (tp=pp=dp=1)
    starting from the distributed run's initial weights."""
    p = s.parallel
    ref = parse_scenario({**s.model_dump(mode="json"), "schedule": "1f1b", "faults": [],
                          "parallel": {"microbatches": p.dp * p.microbatches}})
    options = TrainOptions("sgd", SGD.lr, True, full_model(results, s, "before"))
    _, (only,) = spawn_run(ref, options)
    return ref, only


def assert_step_matches_reference(s: Scenario, results: Sequence[WorkerResult]) -> None:
    ref_scenario, ref = single_process_reference(s, results)
    got, want = sample_losses(results, s), sample_losses([ref], ref_scenario)
    assert sorted(got) == sorted(want) == list(range(s.parallel.dp * s.parallel.microbatches))
    np.testing.assert_allclose([got[k] for k in sorted(got)], [want[k] for k in sorted(want)],
                               rtol=1e-5)
    ref_grads = ref.capture.grads
    for dp in range(s.parallel.dp):  # every replica steps with the dp-averaged gradient
        grads = full_model(results, s, "grads", dp)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            np.testing.assert_allclose(grad, ref_grads[name], rtol=1e-4, atol=1e-6, err_msg=name)
    assert results[0].capture.grad_norm == pytest.approx(ref.capture.grad_norm, rel=1e-5)
    before, after = full_model(results, s, "before"), full_model(results, s, "after")
    for name, grad in ref_grads.items():  # the SGD step really moved the weights
        np.testing.assert_allclose(after[name], before[name] - SGD.lr * grad, rtol=1e-4,
                                   atol=1e-6, err_msg=name)


class LikeMegatronStages(NullStages):
    """What the simulator needs to know of megatron-core stages: they run their
    TP collectives inside each compute and keep embedding and output apart."""

    does_tp_comm = True
    ties_embeddings = False


def recorded_args(events: Sequence[Event]) -> Counter[tuple[Any, ...]]:
    """Each event's name and trace args but its size (real tensors vs the cost
    model) and what a real step measures (loss, gradient norm, the time its
    thread waited for a core)."""
    return Counter((e.name, *sorted((k, repr(v)) for k, v in e.args.items()
                                    if k not in ("bytes", "loss", "grad_norm", "queued_s")))
                   for e in events)


def assert_same_compute_order_as_sim(s: Scenario, events: dict[int, list[Event]]) -> None:
    """Same compute order on every rank, and the same trace args for every op
    both backends record (megatron-core stages run their TP collectives inside
    their computes, where the simulator has tp_allreduce ops); the torch
    backend's iteration ranges, one per rank and iteration, are its own."""
    sim_events = run_sim(s, lambda _rank: LikeMegatronStages()).events
    assert events.keys() == sim_events.keys()
    for rank in events:
        assert compute_sequence(events[rank]) == compute_sequence(sim_events[rank]), rank
        ops = [e for e in events[rank] if e.args["kind"] != "other"]
        steps = [e.args["iteration"] for e in events[rank] if e.args["kind"] == "other"]
        assert steps == list(range(s.iterations)), rank
        names = {e.name for e in ops}
        assert recorded_args(ops) == recorded_args(
            [e for e in sim_events[rank] if e.name in names]), rank


@pytest.fixture(scope="module")
def pp2_dp2():
    s = torch_scenario({"pp": 2, "dp": 2, "microbatches": 4})
    run, results = spawn_run(s, SGD)
    return s, run, results


@pytest.fixture(scope="module")
def tp2_interleaved():
    """tp=2, pp=2, vpp=2 (interleaved); sends held for the next receive (NCCL's path)."""
    s = torch_scenario({"tp": 2, "pp": 2, "vpp": 2, "microbatches": 4}, layers=4,
                 schedule="interleaved")
    run, results = spawn_run(s, SGD, coalesce=True)
    return s, run, results


def test_pp2_dp2_step_equals_single_process_reference(pp2_dp2):
    s, run, results = pp2_dp2
    assert run.backend == "torch" and sorted(run.events) == [0, 1, 2, 3]
    assert_step_matches_reference(s, results)
    dp_bytes = {e.args["bytes"] for ev in run.events.values() for e in ev
                if e.name == "dp_allreduce"}
    assert dp_bytes and 0 not in dp_bytes
    # the last stages' optimizer events carry their replica's mean loss
    losses = {e.args["loss"] for r in (2, 3) for e in run.events[r] if e.name == "optimizer"}
    assert len(losses) == 2 and np.mean(list(losses)) == pytest.approx(
        run.training.loss_per_iteration[0], rel=1e-6)


def test_pp2_dp2_compute_order_equals_sim(pp2_dp2):
    s, run, _ = pp2_dp2
    assert_same_compute_order_as_sim(s, run.events)


def test_tp2_interleaved_step_equals_single_process_reference(tp2_interleaved):
    s, _, results = tp2_interleaved
    assert all(r.coalesce for r in results)
    assert_step_matches_reference(s, results)


def test_tp2_interleaved_compute_order_equals_sim(tp2_interleaved):
    s, run, _ = tp2_interleaved
    assert_same_compute_order_as_sim(s, run.events)


def _injected(events: Sequence[Event], kind: str) -> list[tuple[Event, float]]:
    """(event, seconds the fault model slept inside it) of one kind on a rank."""
    return [(e, e.args[INJECTED]) for e in events if e.args["kind"] == kind and INJECTED in e.args]


def test_throttled_rank_sleeps_what_the_device_model_adds():
    """dp=2, rank 1 throttled 4x: each of its computes sleeps 3x the work it
    measured, inside the op, and its healthy dp peer sleeps nothing. (Wall-time
    ratios under load are measured by experiments/torch_fault_timing.py.) The
    launcher says what it is doing while the ranks start."""
    s = torch_scenario({"dp": 2, "microbatches": 8}, faults=[{"kind": "throttle", "rank": 1,
                                                        "factor": 4.0}])
    phases: list[str] = []
    run, _ = spawn_run(s, on_phase=phases.append)
    assert phases == ["spawning 2 ranks", "building stages", "iteration 1/1"]
    computes = [e for e in run.events[1] if e.args["kind"] == "compute"]
    throttled = _injected(run.events[1], "compute")
    assert len(throttled) == len(computes) == 2 * 8 + 1
    for e, slept in throttled:
        assert slept > 0
        # the work measured is at most the op's own time without the sleep
        assert slept <= 3.0 * (e.dur_s - slept) * (1 + 1e-9) + 1e-9
    assert not any(INJECTED in e.args for e in run.events[0])


def _write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


SKEWED_PIPE = {"name": "pipe", "seed": 1, "iterations": 2, "schedule": "1f1b",
               "parallel": {"pp": 2, "microbatches": 2}, "model": {"layers": 2, **TINY_MODEL},
               "faults": [{"kind": "clock_skew", "rank": 1, "offset_us": 5000.0}]}


def assert_run_dir(out: Path) -> dict[str, Any]:
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "torch" and summary["world_size"] == 2
    assert len(summary["iteration_times_s"]) == 2 and len(summary["loss_per_iteration"]) == 2
    merged = json.loads((out / "trace.json").read_text())["traceEvents"]
    raw = load_trace(out, raw_clocks=True).events[1]
    first = min(e["ts"] for e in merged if e["ph"] == "X" and e["pid"] == 1)
    raw_first = min(e.start_s for e in raw) * 1e6
    assert raw_first - first == pytest.approx(5000.0, abs=1e-2)  # skew in the local view only
    return summary


def test_cli_run_with_torch_backend_writes_a_run_dir(tmp_path: Path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megatronapp.cli", "run",
                           str(_write(tmp_path / "pipe.yaml", SKEWED_PIPE)), "--backend", "torch",
                           "--out", str(out), "--quiet"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "torch backend" in proc.stdout
    assert_run_dir(out)


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun is not installed next to this interpreter")
def test_torchrun_worker_writes_a_run_dir(tmp_path: Path):
    out = tmp_path / "run"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    # one node on loopback (--standalone would look up this host's name)
    proc = subprocess.run([torchrun, "--nnodes", "1", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                           "--local-addr", "127.0.0.1", "-m",
                           "backends.torch.worker", str(_write(tmp_path / "p.yaml", SKEWED_PIPE)),
                           "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_run_dir(out)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for NCCL")
def test_nccl_pipeline_runs_and_follows_the_sim_order():
    s = torch_scenario({"pp": 2, "microbatches": 4}, iterations=2)
    run, results = spawn_run(s)
    assert all(r.dist_backend == "nccl" and r.coalesce for r in results)
    assert_same_compute_order_as_sim(s, run.events)
    assert all(np.isfinite(run.training.loss_per_iteration))


# ------------------------------------------------------------- watchdog
PAIR = {"pp": 2, "microbatches": 1}


def both_receive_first(s: Scenario, stages_for: Any) -> dict[int, Any]:
    """Each of two ranks waits for the other before sending: a deadlock."""
    def program(rank: int):
        yield Recv(src=1 - rank, tag=("fwd", 0, 0), nbytes=0)
    return {r: program(r) for r in range(s.world_size)}


def rank_one_dies(s: Scenario, stages_for: Any) -> dict[int, Any]:
    """Rank 1 exits mid-program while rank 0 waits for its activation."""
    def waiting():
        yield Recv(src=1, tag=("fwd", 0, 0), nbytes=0)

    def dying():
        yield Compute("forward", 0.0, run=partial(os._exit, 3))
    return {0: waiting(), 1: dying()}


def test_deadlocked_pair_stops_with_each_rank_and_its_blocked_recv():
    with pytest.raises(TorchDeadlock) as err:
        spawn_run(torch_scenario(PAIR), programs=both_receive_first, stall_timeout_s=1.0)
    message = str(err.value)
    assert "\n" not in message and message.startswith("deadlock: no rank made progress for 1 s")
    assert err.value.blocked == {0: "Recv(src=1, tag=('fwd', 0, 0))",
                                 1: "Recv(src=0, tag=('fwd', 0, 0))"}


def test_dead_rank_stops_the_run_naming_what_its_peer_waits_for():
    with pytest.raises(TorchDeadlock, match=r"^rank 1 died with exit code 3 after 1 ops; "
                                            r"1 rank\(s\) blocked: rank 0 on Recv\(src=1"):
        spawn_run(torch_scenario(PAIR), programs=rank_one_dies)


def test_cli_deadlock_exits_2_with_one_line_and_no_run_dir(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]):
    monkeypatch.setattr(launch, "PIPELINE", replace(launch.PIPELINE, programs=both_receive_first))
    scenario_file = _write(tmp_path / "pair.yaml", {**SKEWED_PIPE, "parallel": PAIR})
    code = cli.main(["run", str(scenario_file), "--backend", "torch", "--out",
                     str(tmp_path / "run"), "--stall-timeout", "1", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("megatronapp: deadlock: ") and "rank 1 on Recv(src=0" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pair.yaml"]  # nothing half-written


# ------------------------------------------------------------ link faults
LINK_COSTS = {"p2p_s": 0.05}
FAULTY_PAIR = (1, 3)  # pp=2, dp=2: pipeline pairs (0, 2) and (1, 3)


@pytest.mark.parametrize("fault", [{"kind": "slow_link", "factor": 3.0},
                                   {"kind": "link_jitter", "sigma": 1.0}])
def test_faulty_link_sends_leave_as_late_as_the_link_model_prices(fault: dict[str, Any]):
    """Every send over the faulty pair leaves late by what the simulator's
    link model adds for it (replayed from the seed, per direction, in the
    order the sender drew it), and its receive ends no earlier: the delay
    lies inside the receive, where a profiler sees it. Healthy pairs add
    nothing."""
    s = torch_scenario({"pp": 2, "dp": 2, "microbatches": 4}, costs=LINK_COSTS,
                 faults=[{**fault, "ranks": list(FAULTY_PAIR)}])
    run, _ = spawn_run(s)
    injected = []
    for rank in FAULTY_PAIR:
        replay = injected_faults(s, rank)
        sent = _injected(run.events[rank], "p2p")
        assert len(sent) == 4
        peer = FAULTY_PAIR[1 - FAULTY_PAIR.index(rank)]
        received = [e for e in run.events[peer] if e.args["kind"] == "p2p"
                    and e.args["role"] == "recv" and e.args["peer"] == rank]
        for (e, late), recv in zip(sent, received, strict=True):
            assert e.args["role"] == "send" and e.args["peer"] == peer
            assert late == pytest.approx(replay.transfer_extra_s(rank, peer, e.args["bytes"]),
                                         rel=1e-12)
            assert recv.start_s + recv.dur_s >= e.start_s + late
            injected.append(late)
    assert sum(injected) / len(injected) > LINK_COSTS["p2p_s"]  # the seed's draws matter
    for rank in (0, 2):
        assert all(late == 0.0 for _, late in _injected(run.events[rank], "p2p"))


def test_training_on_text_lowers_the_loss_and_random_tokens_do_not() -> None:
    """The default data is a real text: a tiny GPT learns it (character level);
    uniform random tokens leave the loss at log(vocab) (nothing to learn)."""
    data = {"seed": 1, "iterations": 30, "schedule": "1f1b",
            "parallel": {"pp": 2, "microbatches": 4}, "model": {"layers": 2, **TINY_MODEL}}
    options = TrainOptions(optimizer="adam", lr=1e-2)
    text_run, _ = spawn_run(parse_scenario(data), options)
    random_run, _ = spawn_run(parse_scenario({**data, "data": {"kind": "random"}}), options)
    text_loss = text_run.training.loss_per_iteration
    random_loss = random_run.training.loss_per_iteration
    assert len(text_loss) == len(random_loss) == 30
    assert np.mean(text_loss[-5:]) < np.mean(text_loss[:3]) - 0.5
    assert np.mean(random_loss[-5:]) > np.log(TINY_MODEL["vocab"]) - 0.15
