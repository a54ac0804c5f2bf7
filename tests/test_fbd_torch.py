"""Decoupled training on torch.distributed (gloo, worker threads in each
process, one control thread) equals co-located training."""
from __future__ import annotations

import numpy as np
import pytest

from backends.torch.fbd_train import MlpSpec, colocated_reference, run_decoupled
from megatronapp.fbd.ranks import FbdLayout

SPEC = MlpSpec(pp=2, dp=2, microbatches=3, iterations=2)
PIPE = MlpSpec(pp=2, dp=1, microbatches=3, iterations=2)  # 4 processes: keeps CI short


def check_against_reference(spec: MlpSpec, results) -> None:
    ref_losses, ref_grads = colocated_reference(spec)
    logs = {name: log for r in results for name, log in r.logs.items()}
    topo = spec.topo
    for v in range(topo.world_size):
        c = topo.coord(v)
        log = logs[f"B{v}"]
        for it in range(spec.iterations):
            np.testing.assert_allclose(log.grads[it], ref_grads[it][c.pp], rtol=1e-12,
                                       atol=1e-14)
            if c.pp == spec.pp - 1:
                assert log.losses[it] == pytest.approx(ref_losses[it][c.dp], rel=1e-12)


@pytest.mark.slow
def test_decoupled_step_equals_colocated_training():
    layout = FbdLayout(PIPE.topo, forward_tp=1, backward_tp=1)
    results = run_decoupled(PIPE, layout, "words")
    assert len(results) == 4 and all(r.rounds > 0 for r in results)
    assert {name for r in results for name in r.logs} == {"F0", "F1", "B0", "B1"}
    check_against_reference(PIPE, results)


@pytest.mark.slow
def test_threads_sharing_a_device_exchange_through_memory():
    layout = FbdLayout(SPEC.topo, forward_tp=1, backward_tp=1, colocated=True)
    results = run_decoupled(SPEC, layout, "bits")
    assert all(len(r.logs) == 2 for r in results)  # a forward and a backward thread each
    check_against_reference(SPEC, results)
