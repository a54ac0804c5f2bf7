"""MegaFBD on torch.distributed, for real: one process per worker, megatron-core
GPT stages, the one launcher and interpreter. Decoupled training equals
co-located training; hangs and deaths are reported in one line."""
from __future__ import annotations

import os
from dataclasses import replace
from functools import partial
from typing import Any, Sequence

import numpy as np
import pytest

from backends.torch.fbd_worker import FBD
from backends.torch.launch import TorchDeadlock, spawn_run
from backends.torch.stages import TrainOptions
from backends.torch.worker import WorkerResult
from megatronapp.scenario.config import Scenario, parse_scenario
from megatronapp.fbd.run import fbd_layout
from megatronapp.parallel.ops import Compute, Recv
from tests.support import full_model

pytestmark = pytest.mark.slow

MODEL = {"layers": 2, "hidden": 32, "heads": 4, "seq_len": 8, "vocab": 64, "micro_batch_size": 2}
GLOBAL_MICROBATCHES = 4
LR = 0.5


def scenario(parallel: dict[str, int], fbd: dict[str, Any] | None = None, iterations: int = 2
             ) -> Scenario:
    data: dict[str, Any] = {"seed": 3, "iterations": iterations, "schedule": "1f1b",
                            "parallel": parallel, "model": MODEL}
    if fbd is not None:
        data["fbd"] = fbd
    return parse_scenario(data)


@pytest.fixture(scope="module")
def reference() -> WorkerResult:
    """Co-located training in one process (an unsplit GPTModel, every
    microbatch of the global batch): SGD, two iterations."""
    s = scenario({"microbatches": GLOBAL_MICROBATCHES})
    _, (only,) = spawn_run(s, TrainOptions("sgd", LR, capture_first_step=True))
    return only


def backward_full_model(s: Scenario, results: Sequence[WorkerResult], field: str, dp: int
                        ) -> dict[str, np.ndarray]:
    """One replica's full model as its backward workers hold it, TP shards joined."""
    layout = fbd_layout(s)
    backward = [replace(r, rank=layout.worker(r.rank).vrank) for r in results
                if layout.worker(r.rank).phase == "B"]
    return full_model(backward, s, field, dp)


def sample_losses(s: Scenario, results: Sequence[WorkerResult], iteration: int
                  ) -> dict[int, float]:
    """Loss per global sample (dp rank * microbatches + microbatch)."""
    layout, m = fbd_layout(s), s.parallel.microbatches
    out = {}
    for r in results:
        if r.losses.get(iteration):
            dp = layout.topo.coord(layout.worker(r.rank).vrank).dp
            out.update({dp * m + mb: loss for mb, loss in r.losses[iteration].items()})
    return out


def assert_decoupled_equals_colocated(s: Scenario, reference: WorkerResult) -> None:
    options = TrainOptions("sgd", LR, capture_first_step=True,
                           initial_state=reference.capture.before)
    run, results = spawn_run(s, options, job=FBD)
    assert run.fbd.stages == "gpt" and len(results) == 2 * s.world_size
    for iteration in (0, 1):  # iteration 1 runs on the weights handed to the forward workers
        got = sample_losses(s, results, iteration)
        want = reference.losses[iteration]
        assert sorted(got) == sorted(want) == list(range(GLOBAL_MICROBATCHES))
        np.testing.assert_allclose([got[k] for k in sorted(got)],
                                   [want[k] for k in sorted(want)], rtol=1e-5)
    for dp in range(s.parallel.dp):  # every replica steps with the dp-averaged gradient
        for field in ("grads", "after"):
            full = backward_full_model(s, results, field, dp)
            want = getattr(reference.capture, field)
            assert full.keys() == want.keys()
            for name, value in full.items():
                np.testing.assert_allclose(value, want[name], rtol=1e-4, atol=1e-6,
                                           err_msg=f"{field} {name}")


def test_decoupled_gpt_stages_equal_colocated_training_tp1(reference: WorkerResult):
    """pp 2 x dp 2: 8 worker processes; the DP all-reduce goes through the coordinator."""
    assert_decoupled_equals_colocated(scenario({"pp": 2, "dp": 2, "microbatches": 2}, {}),
                                      reference)


def test_decoupled_gpt_stages_equal_colocated_training_tp2(reference: WorkerResult):
    """tp 2 x pp 2, forward tp 1: the two forward TP shards of a stage share a
    device; megatron's TP collectives run beside the control threads."""
    s = scenario({"tp": 2, "pp": 2, "microbatches": 4}, {"forward_tp": 1})
    assert fbd_layout(s).workers_by_device[0] == (0, 1)
    assert_decoupled_equals_colocated(s, reference)


# ------------------------------------------------------------- watchdog
ONE_STAGE = {"microbatches": 1}  # one virtual rank: forward worker 0, backward worker 1


def input_never_sent(s: Scenario, stage_for: Any) -> dict[int, Any]:
    """The backward worker waits for a stage input its forward worker never sends."""
    def forward():
        return
        yield

    def backward():
        yield Recv(src=0, tag=("input", 0, 0), nbytes=0)
    return {0: forward(), 1: backward()}


def forward_worker_dies(s: Scenario, stage_for: Any) -> dict[int, Any]:
    def forward():
        yield Compute("forward", 0.0, run=partial(os._exit, 3))

    def backward():
        yield Recv(src=0, tag=("input", 0, 0), nbytes=0)
    return {0: forward(), 1: backward()}


def test_stall_timeout_stops_a_hung_decoupled_run_naming_the_blocked_op():
    with pytest.raises(TorchDeadlock) as err:
        spawn_run(scenario(ONE_STAGE, {}), programs=input_never_sent, stall_timeout_s=1.0,
                  job=FBD)
    message = str(err.value)
    assert "\n" not in message and "no rank made progress for 1 s" in message
    assert message.endswith("1 rank(s) blocked: rank 1 on Recv(src=0, tag=('input', 0, 0))")
    assert err.value.blocked == {0: "finished", 1: "Recv(src=0, tag=('input', 0, 0))"}


def test_dead_worker_process_is_reported_in_one_line():
    with pytest.raises(TorchDeadlock, match=r"rank 0 died with exit code 3 after 1 ops; "
                                            r"1 rank\(s\) blocked: rank 1 on Recv\(src=0"):
        spawn_run(scenario(ONE_STAGE, {}), programs=forward_worker_dies, job=FBD)
