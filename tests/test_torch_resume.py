"""Mid-run checkpoints on the torch backend: a job stopped after K iterations
and resumed from its checkpoint trains on as if it had never stopped, with
the same dp, or with fewer replicas and the same global batch."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from backends.torch.launch import spawn_run
from backends.torch.resume import CHECKPOINTS, shard_path
from backends.torch.stages import TrainOptions
from megatronapp.errors import UserError
from megatronapp.io.outdirs import own_folder
from megatronapp.scenario.config import Scenario, parse_scenario

from .support import TINY_MODEL

pytestmark = pytest.mark.slow
N, K = 6, 3  # the whole job, the iteration it stops after
ADAM = TrainOptions(optimizer="adam", lr=1e-2)


def job(iterations: int, dp: int = 2, microbatches: int = 2) -> Scenario:
    return parse_scenario({"seed": 3, "iterations": iterations, "schedule": "1f1b",
                           "parallel": {"pp": 2, "dp": dp, "microbatches": microbatches},
                           "model": {"layers": 2, **TINY_MODEL}})


def losses(s: Scenario, workdir: Path, checkpoint_every: int | None = None,
           first_iteration: int = 0) -> list[float]:
    run, _ = spawn_run(s, TrainOptions(ADAM.optimizer, ADAM.lr, workdir=str(workdir),
                                       checkpoint_every=checkpoint_every,
                                       first_iteration=first_iteration))
    assert run.training is not None
    return run.training.loss_per_iteration


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], Path]:
    """The uninterrupted job's losses, and a run directory holding the
    checkpoint of a job stopped after K iterations."""
    whole = losses(job(N), tmp_path_factory.mktemp("whole"))
    # a run's own folder, marked as `run` stages it: older shards are discarded there
    workdir = own_folder(tmp_path_factory.mktemp("stopped"))
    first = losses(job(K), workdir, checkpoint_every=1)  # each older one is dropped
    np.testing.assert_array_equal(first, whole[:K])  # the same job, so far
    return whole, workdir


def test_a_resumed_job_trains_on_exactly_as_the_uninterrupted_one(
        stopped: tuple[list[float], Path]) -> None:
    whole, workdir = stopped
    assert sorted(p.name for p in (workdir / CHECKPOINTS / f"iter_{K:07d}").iterdir()) == \
        ["pp0_tp0.pt", "pp1_tp0.pt"]  # one shard per stage: the replicas hold the same
    assert [p.name for p in (workdir / CHECKPOINTS).iterdir()] == [f"iter_{K:07d}"]  # the latest
    resumed = losses(job(N - K), workdir, first_iteration=K)
    # the same weights, optimizer state and samples, summed in the same order
    np.testing.assert_allclose(resumed, whole[K:], rtol=1e-6)


def test_a_job_resumed_on_fewer_replicas_with_the_same_global_batch_continues(
        stopped: tuple[list[float], Path]) -> None:
    whole, workdir = stopped
    resumed = losses(job(N - K, dp=1, microbatches=4), workdir, first_iteration=K)
    # The same 4 samples per iteration and the same mean loss: only the order
    # of float32 sums differs (one replica sums 4 microbatch gradients, two
    # sum 2 each and all-reduce), relative ~1e-7 per gradient. Adam's step
    # divides by sqrt(v): a rounding-level change of the gradient moves the
    # weights by ~lr * 1e-6 at most per step, so three steps change the loss
    # far below 1e-4 of it, while one skipped or repeated iteration of data
    # moves it by ~1e-2 (the loss falls that much per step at this lr).
    np.testing.assert_allclose(resumed, whole[K:], rtol=1e-4)
    assert not np.allclose(whole[K:], whole[K - 1:N - 1], rtol=1e-3)  # the bound tells them apart


def test_resuming_from_a_checkpoint_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    # both stages' shards are missing: whichever rank looks first is the one named
    shards = "|".join(shard_path(tmp_path, 2, pp, 0).name for pp in (0, 1))
    with pytest.raises(UserError, match=f"checkpoint: .*({shards}) not found"):
        spawn_run(job(2, dp=1), TrainOptions(workdir=str(tmp_path), first_iteration=2))
