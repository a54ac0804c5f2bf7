"""The torch.distributed backend, for real: spawned gloo ranks with megatron-core stages."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pytest
import torch
import yaml

from backends.sim import run_sim
from backends.torch import launch
from backends.torch.faults import injected_faults
from backends.torch.launch import TorchDeadlock, spawn_run
from backends.torch.stages import TrainOptions, merge_tp_shards
from backends.torch.worker import WorkerResult
from megatronapp import cli
from megatronapp.config import Scenario, parse_scenario
from megatronapp.layout import topology_of
from megatronapp.ops import Compute, Recv
from megatronapp.tracer import COMPUTE_NAMES, Event

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = {"hidden": 32, "heads": 4, "seq_len": 8, "vocab": 64, "micro_batch_size": 2}
SGD = TrainOptions(optimizer="sgd", lr=0.5, capture_first_step=True)


def scenario(parallel: dict[str, int], layers: int = 2, **top: Any) -> Scenario:
    return parse_scenario({"seed": 5, "iterations": 1, "schedule": "1f1b", **top,
                           "parallel": parallel, "model": {"layers": layers, **TINY_MODEL}})


def full_model(results: Sequence[WorkerResult], s: Scenario, field: str, dp: int = 0
               ) -> dict[str, np.ndarray]:
    """One replica's full-model tensors, TP shards concatenated."""
    topo = topology_of(s)
    shards: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
    dims: dict[str, int | None] = {}
    for r in results:
        coord = topo.coord(r.rank)
        if coord.dp == dp:
            for name, value in getattr(r.capture, field).items():
                shards[name][coord.tp] = value
                dims[name] = r.capture.partition_dim[name]
    return {n: merge_tp_shards([by_tp[t] for t in sorted(by_tp)], dims[n])
            for n, by_tp in shards.items()}


def sample_losses(results: Sequence[WorkerResult], s: Scenario) -> dict[int, float]:
    """Iteration 0's loss per global sample (dp rank * microbatches + microbatch)."""
    topo, m = topology_of(s), s.parallel.microbatches
    return {topo.coord(r.rank).dp * m + mb: loss
            for r in results for mb, loss in r.losses.get(0, {}).items()}


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


def compute_sequence(events: Sequence[Event]) -> list[tuple[Any, ...]]:
    return [(e.name, e.args.get("microbatch"), e.args.get("chunk"))
            for e in sorted(events, key=lambda e: e.start_s) if e.name in COMPUTE_NAMES]


def assert_same_compute_order_as_sim(s: Scenario, events: dict[int, list[Event]]) -> None:
    sim_events = run_sim(s).events
    assert events.keys() == sim_events.keys()
    for rank in events:
        assert compute_sequence(events[rank]) == compute_sequence(sim_events[rank]), rank


@pytest.fixture(scope="module")
def pp2_dp2():
    s = scenario({"pp": 2, "dp": 2, "microbatches": 4})
    run, results = spawn_run(s, SGD)
    return s, run, results


@pytest.fixture(scope="module")
def tp2_interleaved():
    """tp=2, pp=2, vpp=2 (interleaved); sends held for the next receive (NCCL's path)."""
    s = scenario({"tp": 2, "pp": 2, "vpp": 2, "microbatches": 4}, layers=4,
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


def _compute_s(events: Sequence[Event]) -> float:
    return sum(e.dur_s for e in events if e.name in ("forward", "backward"))


def test_throttled_rank_computes_longer_than_its_dp_peer():
    """dp=2: both ranks do the same work; rank 1 is throttled 4x. On a shared
    CPU both ranks also lose time descheduled, which only lowers the ratio."""
    s = scenario({"dp": 2, "microbatches": 8}, faults=[{"kind": "throttle", "rank": 1,
                                                        "factor": 4.0}])
    run, _ = spawn_run(s)
    assert 2.0 < _compute_s(run.events[1]) / _compute_s(run.events[0]) < 6.0


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
    raw = json.loads((out / "ranks" / "rank1.json").read_text())["traceEvents"]
    first = [e["ts"] for e in merged if e["ph"] == "X" and e["pid"] == 1][0]
    raw_first = [e["ts"] for e in raw if e["ph"] == "X"][0]
    assert raw_first - first == pytest.approx(5000.0, abs=1e-2)  # skew in raw files only
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
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m",
                           "backends.torch.worker", str(_write(tmp_path / "p.yaml", SKEWED_PIPE)),
                           "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_run_dir(out)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for NCCL")
def test_nccl_pipeline_runs_and_follows_the_sim_order():
    s = scenario({"pp": 2, "microbatches": 4}, iterations=2)
    run, results = spawn_run(s)
    assert all(r.dist_backend == "nccl" and r.coalesce for r in results)
    assert_same_compute_order_as_sim(s, run.events)
    assert all(np.isfinite(run.extra["loss_per_iteration"]))


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
        spawn_run(scenario(PAIR), programs=both_receive_first, stall_timeout_s=1.0)
    message = str(err.value)
    assert "\n" not in message and message.startswith("deadlock: no rank made progress for 1 s")
    assert err.value.blocked == {0: "Recv(src=1, tag=('fwd', 0, 0))",
                                 1: "Recv(src=0, tag=('fwd', 0, 0))"}


def test_dead_rank_stops_the_run_naming_what_its_peer_waits_for():
    with pytest.raises(TorchDeadlock, match=r"^rank 1 died with exit code 3 after 1 ops; "
                                            r"1 rank\(s\) blocked: rank 0 on Recv\(src=1"):
        spawn_run(scenario(PAIR), programs=rank_one_dies)


def test_cli_deadlock_exits_2_with_one_line_and_no_run_dir(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]):
    monkeypatch.setattr(launch, "rank_programs", both_receive_first)
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


def _recv_events(events: dict[int, list[Event]], pair: tuple[int, int]) -> list[Event]:
    return [e for r in pair for e in events[r]
            if e.name.startswith("recv") and e.args["peer"] in pair]


def _injected_s(s: Scenario, received: Sequence[Event], receiver_of: dict[int, int]) -> float:
    """What the fault model adds to these receives, replayed from the seed
    (per-direction streams, drawn in receive order as the ranks drew them)."""
    faults = {r: injected_faults(s, r) for r in set(receiver_of.values())}
    return sum(faults[receiver_of[e.args["peer"]]].transfer_extra_s(
        e.args["peer"], receiver_of[e.args["peer"]], e.args["bytes"])
        for e in sorted(received, key=lambda e: e.start_s))


@pytest.mark.parametrize("fault", [{"kind": "slow_link", "factor": 3.0},
                                   {"kind": "link_jitter", "sigma": 1.0}])
def test_faulty_link_receives_take_longer_than_a_healthy_pairs(fault: dict[str, Any]):
    s = scenario({"pp": 2, "dp": 2, "microbatches": 4}, costs=LINK_COSTS,
                 faults=[{**fault, "ranks": list(FAULTY_PAIR)}])
    run, _ = spawn_run(s)
    faulty, healthy = _recv_events(run.events, FAULTY_PAIR), _recv_events(run.events, (0, 2))
    assert len(faulty) == len(healthy) == 8
    injected = _injected_s(s, faulty, {1: 3, 3: 1})
    assert injected / len(faulty) > LINK_COSTS["p2p_s"]  # the seed's draws are not negligible
    faulty_s, healthy_s = sum(e.dur_s for e in faulty), sum(e.dur_s for e in healthy)
    assert faulty_s / healthy_s > 2.0
    # none of the injected delay is lost (a receiver's delay can also lengthen
    # its peer's next wait, so the excess may exceed it)
    assert (faulty_s - healthy_s) / injected > 0.7


@pytest.mark.slow
def test_training_on_text_lowers_the_loss_and_random_tokens_do_not() -> None:
    """The default data is a real text: a tiny GPT learns it (character level);
    uniform random tokens leave the loss at log(vocab) (nothing to learn)."""
    data = {"seed": 1, "iterations": 30, "schedule": "1f1b",
            "parallel": {"pp": 2, "microbatches": 4}, "model": {"layers": 2, **TINY_MODEL}}
    options = TrainOptions(optimizer="adam", lr=1e-2)
    text_run, _ = spawn_run(parse_scenario(data), options)
    random_run, _ = spawn_run(parse_scenario({**data, "data": {"kind": "random"}}), options)
    text_loss = text_run.extra["loss_per_iteration"]
    random_loss = random_run.extra["loss_per_iteration"]
    assert len(text_loss) == len(random_loss) == 30
    assert np.mean(text_loss[-5:]) < np.mean(text_loss[:3]) - 0.5
    assert np.mean(random_loss[-5:]) > np.log(TINY_MODEL["vocab"]) - 0.15
