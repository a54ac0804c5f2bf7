"""The distributed optimizer for real: the torch interpreter's reduce-scatter
and all-gather train exactly like one process."""
from __future__ import annotations

import pytest

from backends.torch.launch import spawn_run
from backends.torch.stages import TrainOptions
from megatronapp.config import parse_scenario

from .test_torch_backend import SGD, full_model, scenario


@pytest.mark.slow
def test_distributed_optimizer_trains_like_a_single_process() -> None:
    s = scenario({"dp": 2, "microbatches": 2}, iterations=2,
                 training={"distributed_optimizer": True})
    run, results = spawn_run(s, SGD)
    names = {e.name for ev in run.events.values() for e in ev}
    assert {"dp_reduce_scatter", "dp_param_all_gather"} <= names and "dp_allreduce" not in names
    # One process with the whole global batch, from the same initial weights: the
    # second iteration's losses match only if the gathered weights are right.
    ref = parse_scenario({**s.model_dump(mode="json"), "training": {},
                          "parallel": {"microbatches": 4}})
    _, (single,) = spawn_run(ref, TrainOptions("sgd", SGD.lr, True, full_model(results, s, "before")))
    for iteration in (0, 1):
        got = {r.rank * 2 + mb: loss for r in results  # rank = dp index (tp = pp = 1)
               for mb, loss in r.losses[iteration].items()}
        assert got == pytest.approx(single.losses[iteration], rel=1e-5)
