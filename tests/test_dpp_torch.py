"""MegaDPP on the torch backend: the adaptive schedule (asynchronous P2P through
IRecv/WaitAny on real gloo ranks) trains exactly like 1F1B."""
from __future__ import annotations

import numpy as np
import pytest

from backends.torch.launch import spawn_run

from .support import SGD, compute_sequence, full_model, sample_losses, torch_scenario

pytestmark = pytest.mark.slow  # every test spawns torch ranks


@pytest.mark.parametrize("parallel,static", [({"pp": 2, "microbatches": 4}, "1f1b"),
                                             ({"pp": 2, "vpp": 2, "microbatches": 4},
                                              "interleaved")])
def test_adaptive_step_equals_static_schedule(parallel: dict, static: str) -> None:
    layers = 2 * parallel.get("vpp", 1)
    adaptive_s = torch_scenario(parallel, layers=layers, schedule="adaptive")
    static_s = torch_scenario(parallel, layers=layers, schedule=static)
    adaptive_run, adaptive = spawn_run(adaptive_s, SGD)
    static_run, fixed = spawn_run(static_s, SGD)
    # the two runs really traversed the task matrix differently
    assert compute_sequence(adaptive_run.events[0]) != compute_sequence(static_run.events[0])
    got, want = sample_losses(adaptive, adaptive_s), sample_losses(fixed, static_s)
    assert sorted(got) == sorted(want) == list(range(4))
    np.testing.assert_allclose([got[k] for k in range(4)], [want[k] for k in range(4)], rtol=1e-6)
    grads, ref = full_model(adaptive, adaptive_s, "grads"), full_model(fixed, static_s, "grads")
    assert grads.keys() == ref.keys()
    for name in ref:
        np.testing.assert_allclose(grads[name], ref[name], rtol=1e-5, atol=1e-7, err_msg=name)
