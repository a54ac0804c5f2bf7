"""The torch backend's in-process parts: CPU shim and fault pricing (no processes)."""
from __future__ import annotations

import pytest
import torch

from backends.torch import megatron_compat
from backends.torch.faults import injected_faults
from megatronapp.config import parse_scenario


def test_cpu_rng_fork_restores_the_outer_stream_and_continues_its_own():
    tracker = megatron_compat.CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(0)
    expected_outer = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("model-parallel-rng"):
        first = torch.rand(3)
    with tracker.fork("model-parallel-rng"):
        second = torch.rand(3)
    assert torch.equal(torch.rand(3), expected_outer)  # outer stream untouched
    assert torch.equal(torch.cat([first, second]),
                       torch.rand(6, generator=torch.Generator().manual_seed(123)))
    with pytest.raises(ValueError):
        tracker.add("other", 123)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim applies only without CUDA")
def test_global_memory_buffer_allocates_on_cpu_after_apply(monkeypatch: pytest.MonkeyPatch):
    from megatron.core.tensor_parallel import random
    from megatron.core.utils import GlobalMemoryBuffer

    # Let the patches be undone after the test.
    monkeypatch.setattr(GlobalMemoryBuffer, "get_tensor", GlobalMemoryBuffer.get_tensor)
    for name in ("_CUDA_RNG_STATE_TRACKER", "_CUDA_RNG_STATE_TRACKER_INITIALIZED"):
        monkeypatch.setattr(random, name, getattr(random, name))
    megatron_compat.apply()
    assert isinstance(random.get_cuda_rng_tracker(), megatron_compat.CpuRNGStatesTracker)
    buffer = GlobalMemoryBuffer()
    small = buffer.get_tensor((2, 3), torch.float32, "x")
    big = buffer.get_tensor((4, 5), torch.float32, "x")
    assert small.device.type == big.device.type == "cpu" and big.shape == (4, 5)


def test_causal_mask_hides_the_future_only():
    mask = megatron_compat.causal_mask(4)[0, 0]
    assert mask.shape == (4, 4)
    assert torch.equal(mask, torch.ones(4, 4, dtype=torch.bool).triu(1))


def _scenario(faults):
    return parse_scenario({"parallel": {"pp": 2, "dp": 2}, "model": {"layers": 2},
                           "costs": {"p2p_s": 0.01, "allreduce_s": 0.02}, "faults": faults})


def test_throttle_stretches_compute_inside_its_window_only():
    faults = injected_faults(_scenario([{"kind": "throttle", "rank": 1, "factor": 3.0,
                                         "start_s": 1.0, "end_s": 2.0}]), 1)
    assert faults.compute_extra_s(0.0, 0.5) == 0.0
    assert faults.compute_extra_s(1.2, 0.1) == pytest.approx(0.2)
    assert faults.compute_extra_s(0.9, 0.2) == pytest.approx(0.2)  # half inside: 0.1 -> 0.3
    assert injected_faults(_scenario([]), 1).compute_extra_s(1.2, 0.1) == 0.0


def test_slow_link_delays_its_own_pair_and_the_rings_crossing_it():
    faults = injected_faults(_scenario([{"kind": "slow_link", "ranks": [0, 2],
                                         "factor": 4.0}]), 2)
    assert faults.transfer_extra_s(0, 2, 1000) == pytest.approx(3 * 0.01)
    assert faults.transfer_extra_s(1, 3, 1000) == 0.0
    assert faults.allreduce_extra_s((0, 2), 1000) == pytest.approx(3 * 0.02)
    assert faults.allreduce_extra_s((0, 1), 1000) == 0.0


def test_link_jitter_never_speeds_a_transfer_up():
    faults = injected_faults(_scenario([{"kind": "link_jitter", "ranks": [0, 2],
                                         "sigma": 1.0}]), 2)
    extras = [faults.transfer_extra_s(0, 2, 1000) for _ in range(200)]
    assert min(extras) == 0.0 and max(extras) > 0.0
